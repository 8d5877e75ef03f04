"""The runner's side of speculative decoding: after each step, the proposer's tokens for the
sequences that may speculate next (the scheduler's say, the request's own opt-out, the
acceptance back-off)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from anna.core.request import Request
from anna.core.speculative import SpeculativeConfig
from anna.runtime.speculative.backoff import AcceptanceBackoff


@dataclass
class ProposalStep:
    """What a proposer may read of the step just run, per request in batch order."""

    requests: list[Request]
    num_new_tokens: list[int]
    spec_token_ids: list[list[int]]  # the proposals the step verified
    inputs: Any  # ModelInputs
    hidden: torch.Tensor  # the target's hidden states of every token of the step, model order
    sampled: dict[str, Any]  # request id -> SampledToken (accepted proposals, then the new token)
    lengths: list[int]  # how many tokens to propose for this request (0: none; it may not speculate)

    def new_tokens(self, i: int) -> list[int]:
        """The tokens request i gained in this step (not yet appended to it)."""
        token = self.sampled.get(self.requests[i].request_id)
        return [] if token is None else [*token.accepted, token.value]


class Proposer(Protocol):
    lookahead: int  # KV slots beyond a step's tokens that the proposer writes (scheduler.num_lookahead_tokens)

    def propose(self, step: ProposalStep) -> dict[str, list[int]]: ...

    def forget(self, request_id: str) -> None: ...


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.backoff = AcceptanceBackoff(config.min_acceptance_rate)

    def after_step(self, batch: Any, inputs: Any, hidden: torch.Tensor, sampled: dict[str, Any]) -> dict[str, list[int]]:
        spec = batch.spec_token_ids or [[]] * len(batch.requests)
        may = batch.may_propose or [False] * len(batch.requests)
        lengths = []
        k = self.config.num_speculative_tokens
        for req, proposed, allowed in zip(batch.requests, spec, may):
            token = sampled.get(req.request_id)
            if proposed and token is not None:
                self.backoff.observe(req.request_id, len(proposed), len(token.accepted))
            lengths.append(self.backoff.allowed(req.request_id, k) if allowed and token is not None
                           and token.value is not None else 0)
        step = ProposalStep(batch.requests, batch.num_new_tokens, spec, inputs, hidden, sampled, lengths)
        drafts = self.proposer.propose(step)
        for req, length in zip(batch.requests, lengths):
            if req.request_id in drafts:
                drafts[req.request_id] = drafts[req.request_id][:length]
        return drafts

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.backoff.forget(request_id)
