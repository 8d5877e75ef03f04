"""From requests' tokens to what callers receive: incremental detokenization, stop strings (the
stop checks that need text), and RequestOutputs. One RequestGroup per request id; a request with
``n > 1`` is a group of n sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from anna.core.errors import RequestError
from anna.core.outputs import CompletionOutput, Logprob, RequestOutput
from anna.core.request import Request
from anna.weights.tokenizer import IncrementalDetokenizer


@dataclass
class SequenceState:
    """Output-side state of one sequence: the request plus its text."""

    req: Request
    detok: IncrementalDetokenizer | None
    text: str = ""


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    final_only: bool = False  # one output, when finished
    seqs: list[SequenceState] = field(default_factory=list)
    error: RequestError | None = None  # why it failed, if it did (all its sequences end with it)

    @property
    def finished(self) -> bool:
        return all(s.req.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(self) -> None:
        self.groups: dict[str, RequestGroup] = {}
        self.seqs: dict[str, tuple[RequestGroup, SequenceState]] = {}

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for state in group.seqs:
            self.seqs[state.req.request_id] = (group, state)

    def forget(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for state in group.seqs:
            self.seqs.pop(state.req.request_id, None)

    @staticmethod
    def add_token(state: SequenceState, token: int, ended_by_token: bool) -> tuple[int, str] | None:
        """Take a token the scheduler appended: its text, unless the token itself ended the
        sequence; returns (index in the text, stop string) when a stop string now ends it."""
        req, p = state.req, state.req.sampling_params
        hit = None
        if not p.detokenize:  # token ids only (vLLM's detokenize=False)
            return None
        if not ended_by_token:
            before = len(state.detok.text)
            state.detok.add(token)
            state.text = state.detok.text
            if p.stop_strings and req.num_output_tokens >= p.min_tokens:
                hit = _find_stop(state.detok.text, p.stop_strings, before)
                if hit is not None:
                    idx, stop = hit
                    state.text = state.detok.text[:idx + (len(stop) if p.include_stop_str_in_output else 0)]
        if req.is_finished and hit is None and req.finish_reason not in ("abort", "error"):
            state.detok.flush()
            state.text = state.detok.text
        return hit

    @staticmethod
    def make_output(group: RequestGroup) -> RequestOutput:
        outs = []
        for i, state in enumerate(group.seqs):
            req = state.req
            text = state.text
            stops = req.sampling_params.stop_strings
            if stops and not req.is_finished:  # hold back what may be the start of a stop string
                text = text[:max(0, len(text) - (max(map(len, stops)) - 1))]
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=list(req.output_token_ids), finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                cumulative_logprob=None if req.sampling_params.logprobs is None else req.cumulative_logprob,
                logprobs=None if req.sampling_params.logprobs is None else list(req.output_logprobs)))
        first = group.seqs[0].req  # the one sequence of a group that computes prompt logprobs
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, outs, group.finished,
                             num_cached_tokens=max(0, first.num_cached_tokens),
                             prompt_logprobs=list(first.prompt_logprobs)
                             if first.sampling_params.prompt_logprobs is not None else None,
                             error=group.error)

    @staticmethod
    def error_output(group: RequestGroup) -> RequestOutput:
        first = group.seqs[0].req
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids,
                             [CompletionOutput(i, "", [], "error") for i in range(len(group.seqs))], True,
                             error=group.error)


def logprob_entry(token: int, chosen: float, top: list[tuple[int, float]], rank: int) -> dict[int, Logprob]:
    """vLLM's shape: the top alternatives by rank (from 1), and the token itself with its rank
    where it is not among them."""
    entry = {tid: Logprob(lp, rank=r + 1) for r, (tid, lp) in enumerate(top)}
    entry.setdefault(token, Logprob(chosen, rank=rank))
    return entry


def _find_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the newly added text (so it may span token boundaries)."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, new_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
