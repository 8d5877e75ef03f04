"""Turn the logits of a batch into next tokens, each request with its own sampling parameters.

Logprobs are reported from the raw model distribution (before penalties and temperature), as
vLLM does. A request with a seed draws from its own generator, so its tokens do not depend on
what else is in the batch. Each step reads the requests' parameters once into per-row tensors
(``SamplingTensors``); the dense transforms run batched over the rows that use them.
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
    # per row: (chosen token logprob, [(token id, logprob), ...], its rank) or None when not asked for
    logprobs: list[tuple[float, list[tuple[int, float]], int] | None]
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
        token, or its processing raises) is reported in ``failed`` and the other rows go on.

        The step's parameters are read once into per-row tensors (``SamplingTensors``) and
        penalties, temperature, top-k, top-p and min-p run as batched tensor ops over the rows
        that use them; what is sparse and per request (allowed tokens, bad words, logit bias, the
        min_tokens bans, grammars) stays per row. Each batched op computes into a new tensor and
        is written back in one assignment, so that when it raises it can run again row by row
        without applying anything twice; draws stay per row, from each request's generator."""
        params = [r.sampling_params for r in requests]
        raw = logits
        if is_plain_greedy(requests):
            return SampleResult(self.argmax(logits), [None] * len(requests))
        logits = logits.clone()
        failed: dict[int, RequestError] = {}
        t = SamplingTensors.of(requests, logits.device)
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:  # before penalties, so that nothing can lift a forbidden token back
            _per_row(constrained, failed, lambda rows: apply_grammar_masks(
                logits, rows, [requests[i].grammar for i in rows]))
        kept: dict[int, torch.Tensor] = {}  # allowed tokens' logits, for a row whose bans then leave nothing
        for i, req in enumerate(requests):  # row by row: neither step may run twice on a row
            if _needs_sparse_processing(req) and i not in failed:
                _per_row([i], failed, lambda rows: _apply_bias(logits[rows[0]], requests[rows[0]], kept, rows[0]))
        penalized = [i for i in t.penalized if i not in failed]
        if penalized:
            _per_row(penalized, failed, lambda rows: _apply_penalties(logits, rows, requests, t))
        for i, req in enumerate(requests):
            if req.num_output_tokens < req.sampling_params.min_tokens and i not in failed:
                _per_row([i], failed, lambda rows: _ban_stops(logits[rows[0]], requests[rows[0]], kept.get(rows[0])))
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
        tokens = torch.zeros(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i in range(len(requests)) if params[i].greedy and i not in failed]
        if greedy:
            def argmax(rows: list[int]) -> None:
                tokens[rows] = logits[rows].argmax(dim=-1)
            _per_row(greedy, failed, argmax)
        sampled = [i for i in range(len(requests)) if not params[i].greedy and i not in failed]
        probs: dict[int, torch.Tensor] = {}

        def distributions(rows: list[int]) -> None:
            for i, row in zip(rows, _probabilities(logits, rows, t)):
                probs[i] = row

        _per_row(sampled, failed, distributions)

        def draw(rows: list[int]) -> None:
            i = rows[0]
            tokens[i] = torch.multinomial(probs[i], 1, generator=self._generator(requests[i]))[0]

        for i in sampled:
            if i not in failed:
                _per_row([i], failed, draw)
        logprobs: list[tuple[float, list[tuple[int, float]], int] | None] = [None] * len(requests)
        want = [i for i, p in enumerate(params) if p.logprobs is not None and i not in failed]
        if want:
            token_list = tokens.tolist()

            def fill(rows: list[int]) -> None:
                found = token_logprobs(raw[rows], [token_list[i] for i in rows], [params[i].logprobs for i in rows])
                for i, entry in zip(rows, found):
                    logprobs[i] = entry

            _per_row(want, failed, fill)
        return SampleResult(tokens, logprobs, failed)


@dataclass
class SamplingTensors:
    """The step's sampling parameters, one entry per row, read once from the requests."""

    temperature: torch.Tensor  # [rows] (1 for greedy rows, which never use it)
    top_k: torch.Tensor  # [rows] long, 0 = off
    top_p: torch.Tensor  # [rows]
    min_p: torch.Tensor  # [rows]
    repetition_penalty: torch.Tensor  # [rows]
    presence_penalty: torch.Tensor  # [rows]
    frequency_penalty: torch.Tensor  # [rows]
    penalized: list[int]  # rows with any of the three penalties

    @classmethod
    def of(cls, requests: list[Request], device: torch.device) -> "SamplingTensors":
        ps = [r.sampling_params for r in requests]

        def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(column([1.0 if p.greedy else p.temperature for p in ps]), column([p.top_k for p in ps], torch.long),
                   column([p.top_p for p in ps]), column([p.min_p for p in ps]),
                   column([p.repetition_penalty for p in ps]), column([p.presence_penalty for p in ps]),
                   column([p.frequency_penalty for p in ps]),
                   [i for i, p in enumerate(ps)
                    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty])


def _probabilities(logits: torch.Tensor, rows: list[int], t: SamplingTensors) -> torch.Tensor:
    """The distributions to draw from for these (sampled) rows: temperature, top-k, softmax, top-p,
    min-p, each over the rows that use it."""
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    # a penalty or a low temperature may push a logit past the float range (repetition_penalty
    # near 0): clip it to the largest finite value, so that softmax stays defined and the token
    # stays the favourite
    scaled = (logits[idx] / t.temperature[idx, None]).clamp_(max=torch.finfo(logits.dtype).max)
    vocab = scaled.shape[-1]
    top_k = t.top_k[idx]
    use_k = ((top_k > 0) & (top_k < vocab)).nonzero().flatten()  # (tokens past a row's k then have probability 0)
    if use_k.numel():
        k = top_k[use_k]
        kth = torch.topk(scaled[use_k], int(k.max())).values.gather(1, (k - 1)[:, None])
        scaled[use_k] = scaled[use_k].masked_fill(scaled[use_k] < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    top_p = t.top_p[idx]
    with_k = (top_k > 0) & (top_k < vocab)
    for use_p in ((top_p < 1.0) & with_k, (top_p < 1.0) & ~with_k):
        use_p = use_p.nonzero().flatten()
        if not use_p.numel():
            continue
        sub = probs[use_p]
        if bool(with_k[use_p[0]]):  # only the top-k tokens have any probability left: order those alone
            sorted_probs, order = sub.topk(int(top_k[use_p].max()), dim=-1)
        else:
            sorted_probs, order = sub.sort(dim=-1, descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > top_p[use_p, None]  # keep the smallest set reaching top_p
        probs[use_p] = torch.zeros_like(sub).scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    min_p = t.min_p[idx]
    use_min = (min_p > 0.0).nonzero().flatten()
    if use_min.numel():
        sub = probs[use_min]
        probs[use_min] = sub.masked_fill(sub < min_p[use_min, None] * sub.max(dim=-1, keepdim=True).values, 0.0)
    return probs


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
                   top: list[int]) -> list[tuple[float, list[tuple[int, float]], int]]:
    """Per row of raw logits: the logprob of its target token, its ``top[row]`` most likely tokens
    as (token id, logprob), and the target's rank (1 = the likeliest), from one log_softmax and
    one topk for all rows."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1))
    ranks = ((lp > chosen_t).sum(dim=1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    k = max(top)
    vals, ids = (torch.topk(lp, k) if k else (lp[:, :0], lp[:, :0].long()))
    vals, ids = vals.tolist(), ids.tolist()
    return [(chosen[r], list(zip(ids[r][:top[r]], vals[r][:top[r]])), ranks[r]) for r in range(len(targets))]


def is_plain_greedy(requests: list[Request]) -> bool:
    """Whether every row's token is the argmax of its raw logits (and no logprobs are asked for)."""
    return all(r.sampling_params.greedy and r.sampling_params.logprobs is None and not _needs_processing(r)
               for r in requests)


def _needs_processing(req: Request) -> bool:
    p = req.sampling_params
    return bool(req.grammar is not None or p.logit_bias or p.allowed_token_ids or req.bad_word_ids
                or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or req.num_output_tokens < p.min_tokens)


def _needs_sparse_processing(req: Request) -> bool:
    p = req.sampling_params
    return bool(p.logit_bias or p.allowed_token_ids or req.bad_word_ids)


def _apply_bias(row: torch.Tensor, req: Request, kept: dict[int, torch.Tensor], i: int) -> None:
    """allowed_token_ids, bad_words and logit_bias on one row, in place (``kept[i]``: the allowed
    tokens' logits, which win back if the min_tokens bans would leave nothing)."""
    p = req.sampling_params
    device = row.device
    if p.allowed_token_ids:
        allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=device)
        kept[i] = row[allowed]
        row.fill_(float("-inf"))
        row[allowed] = kept[i]
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


def _apply_penalties(logits: torch.Tensor, rows: list[int], requests: list[Request], t: SamplingTensors) -> None:
    """Repetition (over prompt and output), presence and frequency penalties (over the output) of
    these rows, as batched ops: computed into a new tensor, written back in one assignment."""
    device = logits.device
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    sub = logits[idx]
    rep = t.repetition_penalty[idx, None]
    seen_r, seen_c = _row_tokens([sorted(set(requests[i].all_token_ids)) for i in rows], device)
    seen = torch.zeros_like(sub, dtype=torch.bool)
    seen[seen_r, seen_c] = True
    sub = torch.where(seen & (rep != 1.0), torch.where(sub > 0, sub / rep, sub * rep), sub)
    out_r, out_c = _row_tokens([requests[i].output_token_ids for i in rows], device)
    counts = torch.zeros_like(sub).index_put_((out_r, out_c), torch.ones_like(out_c, dtype=sub.dtype),
                                              accumulate=True)
    sub = sub - (t.frequency_penalty[idx, None] * counts + t.presence_penalty[idx, None] * (counts > 0).to(sub.dtype))
    logits[idx] = sub


def _row_tokens(per_row: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of every token of every row, as two flat tensors."""
    rows = [r for r, ids in enumerate(per_row) for _ in ids]
    cols = [t for ids in per_row for t in ids]
    return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device))


def _ban_stops(row: torch.Tensor, req: Request, kept: torch.Tensor | None) -> None:
    """Under min_tokens: EOS and the stop token ids may not be sampled yet."""
    p = req.sampling_params
    device = row.device
    banned = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
              if 0 <= t < row.shape[0]]
    if banned:
        row[torch.tensor(banned, dtype=torch.long, device=device)] = float("-inf")
    if p.allowed_token_ids and kept is not None and bool(torch.isneginf(row).all()):  # only banned tokens were allowed: they win
        row[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=device)] = kept
