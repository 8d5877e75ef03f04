"""The speculative decoder a resolved speculative_config asks for."""

from __future__ import annotations

from anna.core.speculative import SpeculativeConfig
from anna.runtime.speculative.decoder import SpeculativeDecoder
from anna.runtime.speculative.ngram import NgramProposer


def build_speculative_decoder(config: SpeculativeConfig) -> SpeculativeDecoder:
    if config.method == "ngram":
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        raise ValueError(f"speculative_config.method: {config.method} is not served yet")
    return SpeculativeDecoder(config, proposer)
