"""The speculative decoder a resolved speculative_config asks for."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from anna.core.speculative import SpeculativeConfig
from anna.model.cache_spec import state_layers
from anna.model.config import ModelConfig, load_model_config
from anna.platforms import Platform
from anna.runtime.speculative.decoder import SpeculativeDecoder
from anna.runtime.speculative.model_proposer import DraftModelProposer
from anna.runtime.speculative.ngram import NgramProposer

log = logging.getLogger(__name__)


def build_speculative_decoder(config: SpeculativeConfig, *, target: torch.nn.Module, target_config: ModelConfig,
                              platform: Platform, block_size: int, activation_dtype: torch.dtype,
                              load: Callable[[str, ModelConfig], torch.nn.Module],
                              executor: Callable[[torch.nn.Module], Any]) -> SpeculativeDecoder:
    """``load``: builds and fills a model from a directory (the target's loader and ops);
    ``executor``: the platform's decode executor for a model, or None."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        proposer: Any = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "draft_model":
        cfg = load_model_config(config.model)
        if cfg.vocab_size > target_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({cfg.vocab_size} tokens) is larger "
                             f"than the target's ({target_config.vocab_size}); a draft model shares the tokenizer")
        model = load(config.model, cfg)
        specs = model.cache_specs(activation_dtype)
        if state_layers(specs):
            raise ValueError(f"speculative_config.model: {cfg.architecture} has recurrent layers; a draft model "
                             "must be attention-only (Llama, Mistral, Qwen2, Qwen3 and their MoE variants)")
        found = executor(model)
        draft_executor = found if found is not None and not found.spare_blocks else None
        proposer = DraftModelProposer(model, k, block_size, platform, target_config.vocab_size, draft_executor)
        proposer.cache_specs = specs
        log.info("Draft model: %s (%s, %d layers)", config.model, cfg.architecture, cfg.num_hidden_layers)
    else:
        from anna.runtime.speculative.mtp import build_mtp_proposer

        proposer = build_mtp_proposer(target, target_config, k, block_size, platform, activation_dtype)
    return SpeculativeDecoder(config, proposer)
