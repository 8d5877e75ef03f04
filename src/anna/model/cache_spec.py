"""What a layer keeps between steps, as the model declares it (``model.cache_specs(dtype)``).

Two kinds: paged attention KV (grows with the sequence: tokens live in blocks, shared between
sequences with the same prefix) and a per-sequence state (fixed size whatever the length: a
recurrent layer's state, one slot per running sequence). Memory planning, the cache managers
(runtime/kv_cache.py, runtime/state_cache.py), the runner's tensors and the exact prompt cache
all work from these specs, so a model mixing both kinds needs no change outside its own file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

import torch

from anna.model.kv_format import KVFormat, kv_format


@dataclass(frozen=True)
class AttentionSpec:
    """Paged K and V, each [blocks, num_kv_heads, block_size, row] (model/attention.py), their rows
    stored as ``cache_dtype`` says (model/kv_format.py; auto: the activation dtype ``dtype``)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None
    cache_dtype: str = "auto"

    kind = "attention"

    @property
    def format(self) -> KVFormat:
        return kv_format(self.cache_dtype, self.dtype, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.format.row_bytes


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


def with_kv_cache_dtype(specs: list[CacheSpec], cache_dtype: str) -> list[CacheSpec]:
    """The specs with every paged attention layer's rows stored as ``cache_dtype`` (--kv-cache-dtype)."""
    return [replace(s, cache_dtype=cache_dtype) if isinstance(s, AttentionSpec) else s for s in specs]


def attention_layers(specs: list[CacheSpec]) -> list[int]:
    return [i for i, s in enumerate(specs) if isinstance(s, AttentionSpec)]


def state_layers(specs: list[CacheSpec]) -> list[int]:
    return [i for i, s in enumerate(specs) if isinstance(s, StateSpec)]


def kv_bytes_per_token(specs: list[CacheSpec]) -> int:
    return sum(s.bytes_per_token for s in specs if isinstance(s, AttentionSpec))


def state_bytes_per_sequence(specs: list[CacheSpec]) -> int:
    return sum(s.bytes_per_sequence for s in specs if isinstance(s, StateSpec))
