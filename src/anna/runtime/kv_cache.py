"""Where tokens' KV lives: a pool of fixed-size blocks, block tables per request, prefix caching.

This module is bookkeeping only (the tensors belong to the model runner). A full block is
identified by a chained hash of (parent block hash, its token ids) over bytes, so equal prefixes
map to equal blocks. Blocks are ref-counted; a block nobody references stays cached in an LRU
free list until its space is needed. Allocation failure is a return value: the scheduler preempts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from anna.core.request import Request


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Stable across processes (never Python's hash()): sha256 of the parent hash and the token ids."""
    h = hashlib.sha256(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently used first. O(1) pop from either end and removal by id.
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.on_allocate = None  # optional callback(block_id), for the memory releaser

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[KVBlock]:
        assert n <= len(self.free)
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            if block.hash is not None:  # evict a cached block
                if self.cached.get(block.hash) is block:
                    del self.cached[block.hash]
                block.hash = None
            block.ref_cnt = 1
            out.append(block)
            if self.on_allocate is not None:
                self.on_allocate(block.block_id)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (removing them from the free list if unreferenced)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        # Later blocks of a sequence are less likely to be shared: evict them first.
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.block_id] = block
                if block.hash is None:  # nothing worth keeping: reuse it first
                    self.free.move_to_end(block.block_id, last=False)

    def register(self, block: KVBlock, h: bytes) -> None:
        if block.hash is None and h not in self.cached:
            block.hash = h
            self.cached[h] = block

    def uncache(self, block_ids) -> int:
        """Forget the cached contents of these (unreferenced) blocks; returns how many were cached."""
        dropped = 0
        for i in block_ids:
            block = self.blocks[i]
            if block.hash is not None and block.ref_cnt == 0:
                if self.cached.get(block.hash) is block:
                    del self.cached[block.hash]
                block.hash = None
                dropped += 1
        return dropped

    def reset_cache(self) -> int:
        """Forget every unreferenced cached block; returns how many were dropped. They hold
        nothing worth keeping now, so they are handed out first, as release() does: their memory
        has been written, where a never-used block may be a fresh page (on CPU, a page fault in
        the step that first writes it: several ms per 2 MB page in a VM)."""
        dropped = [block for block in self.free.values() if block.hash is not None]
        for block in reversed(dropped):  # (in their order, ahead of the rest)
            del self.cached[block.hash]
            block.hash = None
            self.free.move_to_end(block.block_id, last=False)
        return len(dropped)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks, in order
        self.req_registered: dict[str, int] = {}  # how many of the request's blocks are registered as cached
        self.prefix_cache_queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.prefix_cache_hits = 0  # of which found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a prefix a later request may reuse (in use or free)."""
        return len(self.pool.cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / max(1, self.pool.num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def _known_tokens(req: Request) -> int:
        """Tokens whose ids are on the host: sampled tokens still on the device (the sync window's
        placeholders, always the last ones) must not reach a block's hash."""
        return req.num_tokens - len(req.pending)

    def block_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the request's full blocks within its first ``num_tokens`` known tokens."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        num_tokens = min(num_tokens, self._known_tokens(req))
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None, req.all_token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Cached blocks holding a prefix of the request's tokens, and how many tokens they cover.
        The last token is always left to compute, so that there is a position to sample from."""
        if not self.enable_prefix_caching or not req.register_prefix_blocks:
            return [], 0
        hits = []
        for h in self.block_hashes(req, req.num_tokens - 1):
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, req: Request, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching and req.register_prefix_blocks:
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[KVBlock] = (),
                       num_lookahead_tokens: int = 0) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the request's computed (and newly
        hit cached) tokens, and ``num_lookahead_tokens`` beyond them (slots a speculative proposer
        writes its own KV into; never offered to the prefix cache by this step). Returns False,
        changing nothing, when the pool cannot supply them."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_for(num_computed + num_new_tokens + num_lookahead_tokens) - len(blocks) - len(computed)
        from_free = sum(1 for b in computed if b.ref_cnt == 0)
        if max(need, 0) + from_free > self.pool.num_free:
            return False
        self.pool.touch(list(computed))
        blocks.extend(computed)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        self._register(req, num_computed + num_new_tokens)  # their KV is written by this step
        return True

    def _register(self, req: Request, num_written: int) -> None:
        """Offer the request's full blocks within its first ``num_written`` tokens to the prefix
        cache, as far as their token ids are known (the rest follow once they are read back)."""
        if not (self.enable_prefix_caching and req.register_prefix_blocks):
            return
        full = min(num_written, self._known_tokens(req)) // self.block_size
        done = self.req_registered.get(req.request_id, 0)
        if full > done:
            blocks, hashes = self.req_blocks[req.request_id], self.block_hashes(req, full * self.block_size)
            for i in range(done, full):
                self.pool.register(blocks[i], hashes[i])
            self.req_registered[req.request_id] = full

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def free(self, req: Request) -> None:
        """Return the request's blocks; first register those whose KV is computed and whose
        tokens became known after they were allocated (a sync window read back since)."""
        if req.request_id in self.req_blocks:
            self._register(req, min(req.num_computed_tokens, len(self.req_blocks[req.request_id]) * self.block_size))
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.release(blocks)
        self.req_hashes.pop(req.request_id, None)
        self.req_registered.pop(req.request_id, None)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()
