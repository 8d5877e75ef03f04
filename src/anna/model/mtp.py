"""The multi-token-prediction head of the Qwen3.5 family (checkpoint tensors ``mtp.*``).

Trained to predict the token after next: at position p it takes the target's final hidden state
there (which predicted token p + 1) and the embedding of token p + 1, each RMS-normed, joined by
a linear layer (``fc``: [embedding | hidden] -> hidden), runs a full-attention decoder layer of
its own over them (its own paged KV, positions as the target's) and the final norm; the target's
lm_head turns the result into logits for token p + 2. Run again on its own output and the token
it predicted, it proposes one more token each time (speculative decoding's mtp method).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from anna.model.attention import AttentionMetadata
from anna.model.cache_spec import AttentionSpec, CacheSpec
from anna.model.config import ModelConfig
from anna.model.layers import RopeBatch, ZeroCenteredRMSNorm
from anna.model.linear import make_linear
from anna.model.ops import ModelOps


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, activation_dtype: torch.dtype, ops: ModelOps) -> None:
        from anna.model.qwen3_5 import HybridDecoderLayer

        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps, dtype, ops)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps, dtype, ops)
        self.fc = make_linear(2 * hidden, hidden, bias=False, dtype=dtype, ops=ops)
        # full attention, the MLP of the checkpoint's first layer kind (dense, or experts)
        full = dataclasses.replace(cfg, linear_attention=dataclasses.replace(
            cfg.linear_attention, layer_types=("full_attention",) * cfg.mtp_num_hidden_layers))
        self.layers = nn.ModuleList(HybridDecoderLayer(full, i, dtype, activation_dtype, ops)
                                    for i in range(cfg.mtp_num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(hidden, eps, dtype, ops)
        self.config = cfg

    def cache_specs(self, dtype: torch.dtype) -> list[CacheSpec]:
        cfg = self.config
        return [AttentionSpec(cfg.num_key_value_heads, cfg.head_dim, dtype) for _ in self.layers]

    def forward(self, embeddings: torch.Tensor, target_hidden: torch.Tensor, rope: RopeBatch, caches: list,
                meta: AttentionMetadata, step: int = 0) -> torch.Tensor:
        """Hidden states (final-normed, for the lm_head) of the next-next tokens. ``step``: which
        proposal this is (0 = the first); with several layers, each proposal runs one in turn."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(target_hidden)],
                              dim=-1))
        index = step % len(self.layers)
        x, residual = self.layers[index](rope, x, None, caches[index], meta)
        return self.norm(x, residual)[0]
