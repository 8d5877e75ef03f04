"""Turn the logits of a batch into next tokens, each request with its own sampling parameters.

Logprobs are reported from the raw model distribution (before penalties and temperature), as
vLLM does. A request with a seed draws from its own generator, so its tokens do not depend on
what else is in the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from anna.core.errors import RequestError
from anna.core.request import Request
from anna.runtime.structured_output import apply_grammar_masks

log = logging.getLogger(__name__)


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [rows] long, on the device: read it on the host only when needed
    # per row: (chosen token logprob, [(token id, logprob), ...]) or None when not asked for
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    failed: dict[int, RequestError] = field(default_factory=dict)  # rows that got no token, and why


class Sampler:
    def __init__(self, seed: int, device: torch.device,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``argmax``: a faster ``logits.argmax(dim=-1)`` for batches that are all greedy (Anna's
        CPU kernel); torch's otherwise."""
        self.device = device
        self.argmax = argmax or (lambda logits: logits.argmax(dim=-1))
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self.default_generator
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """Sample one token per row. A row whose request cannot be sampled (its bans leave no
        token, or its processing raises) is reported in ``failed`` and the other rows go on."""
        params = [r.sampling_params for r in requests]
        raw = logits
        if all(p.greedy and not _needs_processing(r) for p, r in zip(params, requests)) \
                and all(p.logprobs is None for p in params):
            return SampleResult(self.argmax(logits), [None] * len(requests))
        logits = logits.clone()
        failed: dict[int, RequestError] = {}
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:  # before penalties, so that nothing can lift a forbidden token back
            _per_row(constrained, failed, lambda rows: apply_grammar_masks(
                logits, rows, [requests[i].grammar for i in rows]))
        for i, req in enumerate(requests):  # row by row: neither step may run twice on a row
            if _needs_processing(req) and i not in failed:
                _per_row([i], failed, lambda rows: _apply_penalties_and_bias(logits[rows[0]], requests[rows[0]]))
        if constrained:  # the grammar wins where penalties (min_tokens' EOS ban) left it no token
            dead = [i for i, top in zip(constrained, logits[constrained].max(dim=-1).values.tolist())
                    if top == float("-inf") and i not in failed]
            if dead:
                logits[dead] = raw[dead]
                _per_row(dead, failed, lambda rows: apply_grammar_masks(
                    logits, rows, [requests[i].grammar for i in rows]))
        for i, top in enumerate(logits.max(dim=-1).values.tolist()):
            if i not in failed and not top > float("-inf"):  # -inf: nothing left; nan: broken logits
                failed[i] = _unsamplable(requests[i]) if top == float("-inf") else RequestError(
                    "the model produced non-finite logits for this request")
        finite_max = torch.finfo(logits.dtype).max
        tokens = torch.zeros(len(requests), dtype=torch.long, device=logits.device)

        def sample(rows: list[int]) -> None:
            tokens[rows[0]] = self._sample_row(logits[rows[0]], requests[rows[0]], finite_max)

        for i in range(len(requests)):
            if i not in failed:
                _per_row([i], failed, sample)
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(requests)
        want = [i for i, p in enumerate(params) if p.logprobs is not None and i not in failed]
        if want:
            token_list = tokens.tolist()

            def fill(rows: list[int]) -> None:
                found = token_logprobs(raw[rows], [token_list[i] for i in rows], [params[i].logprobs for i in rows])
                for i, entry in zip(rows, found):
                    logprobs[i] = entry

            _per_row(want, failed, fill)
        return SampleResult(tokens, logprobs, failed)

    def _sample_row(self, row: torch.Tensor, req: Request, finite_max: float) -> torch.Tensor:
        p = req.sampling_params
        if p.greedy:
            return row.argmax()
        # a penalty or a low temperature may push a logit past the float range (repetition_penalty
        # near 0): clip it to the largest finite value, so that softmax stays defined and the token
        # stays the favourite
        row = (row / p.temperature).clamp_(max=finite_max)
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cum = sorted_probs.cumsum(-1)
            drop = (cum - sorted_probs) > p.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return torch.multinomial(probs, 1, generator=self._generator(req))[0]


def _per_row(rows: list[int], failed: dict[int, RequestError], fn: Callable[[list[int]], None]) -> None:
    """Run ``fn`` over these rows at once; if it raises, row by row, so that only the rows that
    raise alone are marked failed (``fn`` must be safe to run again on a row)."""
    if not rows:
        return
    try:
        fn(rows)
        return
    except Exception as exc:
        if len(rows) == 1:
            log.exception("sampling failed for request row %d", rows[0])
            failed[rows[0]] = RequestError.internal(exc)
            return
    for row in rows:
        _per_row([row], failed, fn)


def _unsamplable(req: Request) -> RequestError:
    """The 400 for a row that its own bans and masks left with no token to sample."""
    p = req.sampling_params
    fields = [name for name, on in (("allowed_token_ids", p.allowed_token_ids), ("bad_words", req.bad_word_ids),
                                    ("min_tokens", req.num_output_tokens < p.min_tokens),
                                    ("structured_outputs", req.grammar is not None)) if on]
    names = ", ".join(fields) or "sampling parameters"
    return RequestError(f"{names}: together they leave no token that may be generated next", status=400,
                        param=fields[0] if fields else None)


def token_logprobs(logits: torch.Tensor, targets: list[int],
                   top: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of raw logits: the logprob of its target token and its ``top[row]`` most likely
    tokens as (token id, logprob), from one log_softmax and one topk for all rows."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(top)
    vals, ids = (torch.topk(lp, k) if k else (lp[:, :0], lp[:, :0].long()))
    vals, ids = vals.tolist(), ids.tolist()
    return [(chosen[r], list(zip(ids[r][:top[r]], vals[r][:top[r]]))) for r in range(len(targets))]


def _needs_processing(req: Request) -> bool:
    p = req.sampling_params
    return bool(req.grammar is not None or p.logit_bias or p.allowed_token_ids or req.bad_word_ids
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or req.num_output_tokens < p.min_tokens)


def _apply_penalties_and_bias(row: torch.Tensor, req: Request) -> None:
    p = req.sampling_params
    device = row.device
    if p.allowed_token_ids:
        allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=device)
        kept = row[allowed]
        row.fill_(float("-inf"))
        row[allowed] = kept
    if req.bad_word_ids:  # a word's last token is banned where the output ends with the rest of it
        out = req.output_token_ids
        banned_words = {seq[-1] for seq in req.bad_word_ids
                        if len(seq) == 1 or (len(out) >= len(seq) - 1 and out[len(out) - len(seq) + 1:] == seq[:-1])}
        if banned_words:
            row[torch.tensor(sorted(banned_words), dtype=torch.long, device=device)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)
        vals = torch.tensor(list(p.logit_bias.values()), device=device)
        row.index_add_(0, ids, vals.to(row.dtype))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids, device=device), minlength=row.shape[0])
        counts = counts[:row.shape[0]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if req.num_output_tokens < p.min_tokens:
        banned = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
                  if 0 <= t < row.shape[0]]
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")
        if p.allowed_token_ids and bool(torch.isneginf(row).all()):  # only banned tokens were allowed: they win
            row[allowed] = kept
