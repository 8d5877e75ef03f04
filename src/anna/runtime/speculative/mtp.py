"""Proposals from the target's own multi-token-prediction head (model/mtp.py).

Its entry at position p reads the target's hidden state at p and token p + 1; a step's catch-up
runs the positions the step computed, the last of which reads the step's new token (or, after a
prefill chunk, the next prompt token), and its prediction is the first proposal. Each further
proposal runs the head on its own previous output and the token it proposed.

A block shared through the prefix cache carries the head's KV as its first owner computed it;
its last entry read the token after the block, which a request that shares the block may not
have. Its proposals then read one slightly different entry: they may be accepted less often,
never wrongly (verification decides).
"""

from __future__ import annotations

import torch

from anna.model.config import ModelConfig
from anna.platforms import Platform
from anna.runtime.speculative.decoder import ProposalStep
from anna.runtime.speculative.model_proposer import CatchUp, ModelProposer


class MtpProposer(ModelProposer):
    def __init__(self, target: torch.nn.Module, num_tokens: int, block_size: int, platform: Platform,
                 activation_dtype: torch.dtype) -> None:
        super().__init__(num_tokens, block_size, platform, target.config.vocab_size)
        self.target = target
        self.head = target.mtp
        self.cache_specs = self.head.cache_specs(activation_dtype)
        self.lookahead = num_tokens - 1  # the first proposal comes from the step's own positions
        self.sliding_window = None
        self._proposal = 0

    def entries(self, step: ProposalStep, i: int, start: int, computed: int) -> CatchUp:
        req = step.requests[i]
        known = req.all_token_ids + step.new_tokens(i)
        first_row = step.inputs.logits_indices[step.inputs.order.index(i)] - step.num_new_tokens[i] + 1
        return CatchUp(i, known[start + 1:start + computed + 1], start, list(range(first_row, first_row + computed)),
                       step.lengths[i] > 0)

    def propose(self, step: ProposalStep) -> dict[str, list[int]]:
        self._proposal = 0
        return super().propose(step)

    def forward(self, input_ids, positions, hidden, meta) -> torch.Tensor:
        target = self.target
        rope = target.rotary.batch(positions, hidden.dtype)
        out = self.head(target.embed(input_ids), hidden, rope, self.caches, meta, self._proposal)
        self._proposal += 1
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


def build_mtp_proposer(target: torch.nn.Module, cfg: ModelConfig, num_tokens: int, block_size: int,
                       platform: Platform, activation_dtype: torch.dtype) -> MtpProposer:
    if getattr(target, "mtp", None) is None:
        raise ValueError(f"speculative_config.method: mtp needs a checkpoint with a multi-token-prediction head "
                         f"(mtp.* tensors and mtp_num_hidden_layers in config.json); {cfg.architecture} has none")
    return MtpProposer(target, num_tokens, block_size, platform, activation_dtype)
