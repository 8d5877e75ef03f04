"""Prompt lookup: propose the tokens that followed the last time the sequence's latest n tokens
occurred in its own context (prompt and output), for the longest such n in
[prompt_lookup_min, prompt_lookup_max]. No weights: it pays where the output repeats its input
(editing a passage, code, quoting), which is where code assistants live. A match close to the
end (a repeating stretch) is continued with its own period, up to the proposal length.

Each sequence keeps an index of its n-grams (n-gram -> where its most recent occurrence ended),
extended by the tokens each step added, so a lookup costs the same at 100 or 100,000 tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from anna.runtime.speculative.decoder import ProposalStep


@dataclass
class _NgramIndex:
    indexed: int = 1  # n-grams ending before this position (each with a token after it) are indexed
    last_end: list[dict[tuple[int, ...], int]] = field(default_factory=list)  # per n: n-gram -> end


class NgramProposer:
    lookahead = 0  # proposals need no KV of their own

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, _NgramIndex] = {}

    def propose(self, step: "ProposalStep") -> dict[str, list[int]]:
        out = {}
        for i, req in enumerate(step.requests):
            if step.lengths[i]:
                found = self.lookup(req.request_id, req.all_token_ids + step.new_tokens(i))
                if found:
                    out[req.request_id] = found
        return out

    def lookup(self, request_id: str, tokens: list[int]) -> list[int]:
        """Up to ``num_tokens`` tokens to follow ``tokens`` (the sequence's whole context)."""
        index = self.indexes.get(request_id)
        if index is None:
            index = self.indexes[request_id] = _NgramIndex(last_end=[{} for _ in range(self.max_n + 1)])
        for end in range(index.indexed, len(tokens)):  # n-grams ending at `end`, followed by tokens[end]
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.last_end[n][tuple(tokens[end - n:end])] = end
        index.indexed = max(index.indexed, len(tokens))
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = index.last_end[n].get(tuple(tokens[-n:]))
            if end is not None:
                found = tokens[end:end + self.num_tokens]
                while len(found) < self.num_tokens:  # the match runs into the end: a repeating stretch, so
                    found.append(found[len(found) - (len(tokens) - end)])  # continue it with its own period
                return found
        return []

    def forget(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
