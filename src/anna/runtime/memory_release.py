"""Adaptive memory release: an idle engine gives KV memory back.

The KV pool is reserved up front but committed lazily: on CPU a page of the pool costs RAM only
once a block in it is written. The pool is divided into chunks of ``chunk_blocks`` blocks; a
chunk becomes resident when one of its blocks is first handed out. When the engine is idle and
free memory is below the floor, or resident-but-unused KV exceeds the allowed gap, the releaser
returns every chunk none of whose blocks is in use: cached prefix blocks in it are evicted and
its pages are dropped (the platform's ``release_pages``: madvise(MADV_DONTNEED) on CPU). It also
empties the exact prompt cache and the device allocator's cache. Blocks in use are never touched.
Free memory is the platform's (host RAM on CPU, device memory on a GPU).

The other way round, an idle engine commits fresh chunks ahead of use (``commit_ahead``): the first
write to a fresh page is a page fault, which in a VM can cost several milliseconds per 2 MB page,
and a decode step whose new blocks start a page in every layer's K and V tensors waits for all of
them at once (350 ms to 1 s measured on 2-vCPU VMs; docs/BENCHMARKS.md). Only chunks never
resident are committed, in the order the pool hands fresh blocks out (ascending ids), so a release
is never undone, and never past the allowed idle gap or under the free-memory floor.
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
    commit_ahead_mib: float = 256.0  # an idle engine commits this much fresh KV ahead of use; 0: off


def release_blocks(platform: Platform, kv_caches: list, first: int, count: int) -> int:
    """Hand the memory of blocks [first, first + count) of every paged layer back; bytes returned."""
    return sum(platform.release_pages(k, first, count) + platform.release_pages(v, first, count)
               for k, v in kv_caches)


def commit_blocks(platform: Platform, kv_caches: list, first: int, count: int) -> int:
    """Commit the memory of blocks [first, first + count) of every paged layer (which must be free
    and hold nothing); bytes written."""
    return sum(platform.commit_pages(k, first, count) + platform.commit_pages(v, first, count)
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
        self.ahead: set[int] = set()  # resident chunks committed ahead, none of whose blocks was handed out since
        # chunks below this one have been resident, or are (the pool hands fresh blocks out in ascending
        # order), so commit_ahead never goes back to a chunk a release returned
        self.next_fresh = 0
        self.partial: tuple[int, int] | None = None  # (chunk, layers done) of a chunk being committed ahead

    def _touch(self, block_id: int) -> None:
        chunk = block_id // self.chunk_blocks
        self.resident.add(chunk)
        self.next_fresh = max(self.next_fresh, chunk + 1)
        self._stop_committing(chunk)  # in use now: its other layers' pages are written as they are used

    def _stop_committing(self, chunk: int) -> None:
        """The chunk is no longer fresh memory held ahead of use (it was handed out or returned)."""
        self.ahead.discard(chunk)
        if self.partial is not None and self.partial[0] == chunk:
            self.partial = None

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
            self._stop_committing(chunk)
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

    def commit_ahead(self, seconds: float) -> bool:
        """From the idle loop: commit fresh chunks, one layer's K and V at a time, until
        ``commit_ahead_mib`` is committed ahead of use or ``seconds`` have passed (a request that
        arrives meanwhile waits at most about that long). Returns whether there is more to do."""
        target = self.policy.commit_ahead_mib * MIB
        if self.policy.max_gap_mib > 0:
            target = min(target, self.policy.max_gap_mib * MIB)
        if target <= 0 or not self.platform.pages_on_demand:
            return False
        chunk_bytes = self.chunk_blocks * self.block_bytes
        deadline = time.monotonic() + seconds
        while True:
            if self.partial is None:
                floor = self.policy.min_free_mib * MIB
                if (len(self.ahead) + 1) * chunk_bytes > target or self.free_bytes() - chunk_bytes < floor:
                    return False
                chunk = self._next_fresh_chunk()
                if chunk is None:
                    return False
                self.partial = (chunk, 0)
                self.resident.add(chunk)
            chunk, layer = self.partial
            first = chunk * self.chunk_blocks
            count = min(self.chunk_blocks, self.kv.num_blocks - first)
            commit_blocks(self.platform, self.kv_caches[layer:layer + 1], first, count)
            if self.workers is not None:  # the other ranks' share of the same layer and blocks
                self.workers.send("commit_blocks", layer, first, count)
            if layer + 1 < len(self.kv_caches):
                self.partial = (chunk, layer + 1)
            else:
                self.partial = None
                self.ahead.add(chunk)
            if time.monotonic() >= deadline:
                return True

    def _next_fresh_chunk(self) -> int | None:
        """The lowest chunk that has never been resident and whose blocks are all free."""
        chunks = -(-self.kv.num_blocks // self.chunk_blocks)
        while self.next_fresh < chunks:
            chunk = self.next_fresh
            self.next_fresh += 1
            if chunk not in self.resident and not self._chunk_in_use(chunk):
                return chunk
        return None
