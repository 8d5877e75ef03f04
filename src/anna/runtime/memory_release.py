"""Adaptive memory release: an idle engine gives KV memory back.

The KV pool is reserved up front but committed lazily: on CPU a page of the pool costs RAM only
once a block in it is written. The pool is divided into chunks of ``chunk_blocks`` blocks; a
chunk becomes resident when one of its blocks is first handed out. When the engine is idle and
free memory is below the floor, or resident-but-unused KV exceeds the allowed gap, the releaser
returns every chunk none of whose blocks is in use: cached prefix blocks in it are evicted and
its pages are dropped (the platform's ``release_pages``: madvise(MADV_DONTNEED) on CPU). It also
empties the exact prompt cache and the device allocator's cache. Blocks in use are never touched.
Free memory is the platform's (host RAM on CPU, device memory on a GPU).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from anna.platforms import Platform
from anna.runtime.kv_cache import KVCacheManager
from anna.runtime.prompt_cache import PromptCache

log = logging.getLogger(__name__)

MIB = 2**20


@dataclass
class ReleasePolicy:
    sweep_interval_s: float = 30.0  # 0: no periodic sweeps
    min_free_mib: float = 1024.0  # release when free memory falls below this
    max_gap_mib: float = 1024.0  # release when resident-but-unused KV exceeds this; 0: off


def release_blocks(platform: Platform, kv_caches: list, first: int, count: int) -> int:
    """Hand the memory of blocks [first, first + count) of every paged layer back; bytes returned."""
    return sum(platform.release_pages(k, first, count) + platform.release_pages(v, first, count)
               for k, v in kv_caches)


class MemoryReleaser:
    def __init__(self, kv: KVCacheManager, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 prompt_cache: PromptCache, platform: Platform, chunk_blocks: int, policy: ReleasePolicy,
                 workers: Any = None) -> None:
        """``kv_caches``: the (K, V) tensors of the paged layers, whose rows are blocks. ``workers``:
        the other ranks of a tensor-parallel model, which return the same blocks' memory."""
        self.kv, self.kv_caches, self.prompt_cache, self.platform = kv, kv_caches, prompt_cache, platform
        self.workers = workers
        self.chunk_blocks = max(1, chunk_blocks)
        self.policy = policy
        self.block_bytes = sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size() for k, v in kv_caches)
        self.last_sweep = time.monotonic()
        self.releases = 0
        kv.pool.on_allocate = self._touch
        self.resident: set[int] = set()  # chunk ids with pages that may be committed

    def _touch(self, block_id: int) -> None:
        self.resident.add(block_id // self.chunk_blocks)

    def _chunk_in_use(self, chunk: int) -> bool:
        blocks = self.kv.pool.blocks[chunk * self.chunk_blocks:(chunk + 1) * self.chunk_blocks]
        return any(b.ref_cnt > 0 for b in blocks)

    def resident_bytes(self) -> int:
        return len(self.resident) * self.chunk_blocks * self.block_bytes

    def idle_gap_bytes(self) -> int:
        """KV memory that is resident but holds no block in use."""
        if not self.platform.pages_on_demand:
            return self.platform.allocator_idle_bytes()
        return sum(self.chunk_blocks * self.block_bytes for c in self.resident if not self._chunk_in_use(c))

    def free_bytes(self) -> int:
        return self.platform.memory_info().free

    def should_release(self) -> str | None:
        p = self.policy
        if self.free_bytes() < p.min_free_mib * MIB:
            return f"free memory below {p.min_free_mib:.0f} MiB"
        if p.max_gap_mib > 0 and self.idle_gap_bytes() > p.max_gap_mib * MIB:
            return f"more than {p.max_gap_mib:.0f} MiB of KV memory idle"
        return None

    def release(self, reason: str) -> dict[str, int]:
        """Return every idle chunk, evict the prompt cache, empty the allocator cache."""
        chunks = evicted = dropped = 0
        released = []
        for chunk in sorted(self.resident):
            if self._chunk_in_use(chunk):
                continue
            first = chunk * self.chunk_blocks
            count = min(self.chunk_blocks, self.kv.num_blocks - first)
            evicted += self.kv.pool.uncache(range(first, first + count))
            dropped += release_blocks(self.platform, self.kv_caches, first, count)
            released.append((first, count))
            self.resident.discard(chunk)
            chunks += 1
        entries = self.prompt_cache.clear()
        self.platform.empty_cache()
        if self.workers is not None and released:
            self.workers.send("release_blocks", released)
        self.releases += 1
        freed = {"kv_chunks": chunks, "kv_bytes": dropped, "prefix_blocks_evicted": evicted,
                 "prompt_cache_entries": entries}
        log.info("Memory release (%s): returned %d idle KV chunks (%.1f MiB), evicted %d cached prefix blocks "
                 "and %d prompt-cache entries", reason, chunks, dropped / MIB, evicted, entries)
        return freed

    def maybe_release(self, idle: bool, periodic: bool) -> dict[str, int] | None:
        """Called by the engine: after a request ends (periodic=False: only under the free-memory
        floor) and from the idle loop (periodic=True: every sweep interval, either condition)."""
        if not idle:
            return None
        if periodic:
            if self.policy.sweep_interval_s <= 0 or time.monotonic() - self.last_sweep < self.policy.sweep_interval_s:
                return None
            self.last_sweep = time.monotonic()
            reason = self.should_release()
        else:
            reason = (f"free memory below {self.policy.min_free_mib:.0f} MiB"
                      if self.free_bytes() < self.policy.min_free_mib * MIB else None)
        return self.release(reason) if reason else None
