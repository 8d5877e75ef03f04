"""What a layer keeps between steps, as the model declares it (``model.cache_specs(dtype)``).

Two kinds: paged attention KV (grows with the sequence: tokens live in blocks, shared between
sequences with the same prefix) and a per-sequence state (fixed size whatever the length: a
recurrent layer's state, one slot per running sequence). Memory planning, the cache managers
(runtime/kv_cache.py, runtime/state_cache.py), the runner's tensors and the exact prompt cache
all work from these specs, so a model mixing both kinds needs no change outside its own file.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """Paged K and V, each [blocks, num_kv_heads, block_size, head_dim] (model/attention.py)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    kind = "attention"

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class StateTensor:
    name: str
    shape: tuple[int, ...]  # of one sequence's state
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StateSpec:
    """Named tensors of a fixed size per sequence; the runner keeps them as [slots, *shape]."""

    tensors: tuple[StateTensor, ...]

    kind = "state"

    @property
    def bytes_per_sequence(self) -> int:
        return sum(t.nbytes for t in self.tensors)


CacheSpec = AttentionSpec | StateSpec


def attention_layers(specs: list[CacheSpec]) -> list[int]:
    return [i for i, s in enumerate(specs) if isinstance(s, AttentionSpec)]


def state_layers(specs: list[CacheSpec]) -> list[int]:
    return [i for i, s in enumerate(specs) if isinstance(s, StateSpec)]


def kv_bytes_per_token(specs: list[CacheSpec]) -> int:
    return sum(s.bytes_per_token for s in specs if isinstance(s, AttentionSpec))


def state_bytes_per_sequence(specs: list[CacheSpec]) -> int:
    return sum(s.bytes_per_sequence for s in specs if isinstance(s, StateSpec))
