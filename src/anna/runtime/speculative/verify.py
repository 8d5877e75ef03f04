"""Verifying proposed tokens: sample every position as plain decoding would, keep the proposals
up to the first one the target's own sample disagrees with.

Position j of a sequence that proposed d_0..d_{k-1} holds the target's logits after d_0..d_{j-1}.
Each position is sampled by the ordinary sampler, with the request as it would be had the
accepted proposals already been appended (penalties, bad words, min_tokens and the grammar all
see them; they are taken back afterwards), and in order, stopping at the first sample that
differs from its proposal: that sample is the step's last token. When all k are accepted, the
sample at position k is a token of its own.

This is the speculative-sampling rule for proposals that are single tokens (the proposers here
are deterministic: the draft distribution q is a point mass on d_j). The rule accepts d_j with
probability min(1, p(d_j) / q(d_j)) = p(d_j) and otherwise samples from the residual max(p - q, 0)
renormalised, which is p without d_j, renormalised; drawing x ~ p and accepting when x == d_j
gives the same: P(accept) = p(d_j), and a rejection's x is distributed as p given x != d_j. Every
token is thus a draw from the target's distribution given the tokens before it, and a seeded
request draws the same random numbers in the same order as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from anna.core.errors import RequestError
from anna.core.request import Request
from anna.runtime.sampler import Sampler, is_plain_greedy
from anna.runtime.scheduler import stop_after


@dataclass
class Verified:
    """Per request of the batch (in the caller's order): the tokens of the step (accepted
    proposals, then the sampled token) and their logprobs; ``failed``: by index, with why."""

    tokens: list[list[int]]
    logprobs: list[list[tuple | None]]
    failed: dict[int, RequestError] = field(default_factory=dict)


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[list[int]], requests: list[Request],
           proposals: list[list[int]], max_model_len: int) -> Verified:
    """``logits``: [R, vocab]; ``rows[i]``: the rows of request i, one per position (1 + its
    proposals)."""
    n = len(requests)
    if is_plain_greedy(requests):  # one argmax over every row, then the longest matching run
        best = sampler.argmax(logits).tolist()
        tokens = []
        for i in range(n):
            out = []
            for j, row in enumerate(rows[i]):
                out.append(best[row])
                if j == len(proposals[i]) or best[row] != proposals[i][j] or _ends(requests[i], out, max_model_len):
                    break
            tokens.append(out)
        return Verified(tokens, [[None] * len(t) for t in tokens])
    tokens = [[] for _ in range(n)]
    logprobs: list[list[tuple | None]] = [[] for _ in range(n)]
    failed: dict[int, RequestError] = {}
    appended = [0] * n
    alive = list(range(n))
    try:
        for j in range(max(len(r) for r in rows)):
            col = [i for i in alive if j < len(rows[i])]
            if not col:
                break
            result = sampler(logits[[rows[i][j] for i in col]], [requests[i] for i in col])
            drawn = result.tokens.tolist()
            alive = []
            for c, i in enumerate(col):
                if c in result.failed:
                    failed[i] = result.failed[c]
                    continue
                token = drawn[c]
                tokens[i].append(token)
                logprobs[i].append(result.logprobs[c])
                if j < len(proposals[i]) and token == proposals[i][j]:
                    _append(requests[i], token)  # the next position sees it, as it would without speculation
                    appended[i] += 1
                    if stop_after(requests[i], token, max_model_len) is None:
                        alive.append(i)
    finally:
        for i, m in enumerate(appended):
            if m:
                _take_back(requests[i], m)
    return Verified(tokens, logprobs, failed)


def _ends(req: Request, out: list[int], max_model_len: int) -> bool:
    """Whether the last of ``out`` (tokens after the request's own; no grammar) would end the
    request, so that no later position may be accepted."""
    for token in out:
        req.append_output_token(token)
    try:
        return stop_after(req, out[-1], max_model_len) is not None
    finally:
        _take_back(req, len(out))


def _append(req: Request, token: int) -> None:
    req.append_output_token(token)
    if req.grammar is not None:
        req.grammar.consume_token(token)


def _take_back(req: Request, m: int) -> None:
    del req.output_token_ids[-m:], req.all_token_ids[-m:]
    if req.grammar is not None:
        req.grammar.rollback(m)
