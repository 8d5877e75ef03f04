"""The exact prompt cache: a few whole prompts' KV, kept resident, hit only when a new prompt is
token-for-token equal to a cached one.

Block sharing (the prefix cache) covers the paged KV layout; this cache is for what block sharing
cannot serve (a KV layout without shareable blocks, per-sequence recurrent state). The scheduler
decides hits from token ids alone; the model runner copies the KV in and out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PromptCacheEntry:
    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of tokens[:-1], [n, kv_heads, dim]


class PromptCache:
    def __init__(self, size: int, max_tokens: int) -> None:
        self.size = size  # entries kept; 0 = off
        self.max_tokens = max_tokens  # longest prompt cached; 0 = no limit
        self.entries: OrderedDict[tuple[int, ...], PromptCacheEntry] = OrderedDict()
        self.lookups = 0
        self.hits = 0

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def covers(self, prompt: list[int]) -> bool:
        """Prompts this cache is responsible for (they do not also register prefix blocks)."""
        return self.enabled and len(prompt) >= 2 and (self.max_tokens == 0 or len(prompt) <= self.max_tokens)

    def lookup(self, prompt: list[int], count: bool = True) -> PromptCacheEntry | None:
        if not self.covers(prompt):
            return None
        entry = self.entries.get(tuple(prompt))
        if count:
            self.lookups += 1
            self.hits += entry is not None
        if entry is not None:
            self.entries.move_to_end(entry.tokens)
        return entry

    def insert(self, prompt: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        key = tuple(prompt)
        self.entries[key] = PromptCacheEntry(key, kv)
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def __contains__(self, prompt: list[int]) -> bool:
        return tuple(prompt) in self.entries

    def clear(self) -> int:
        n = len(self.entries)
        self.entries.clear()
        return n
