"""One cache manager per kind of cache the model declares (model/cache_spec.py), behind the one
interface the scheduler allocates through: paged KV blocks (kv_cache.py) for attention layers
and per-sequence state slots (state_cache.py) for recurrent ones."""

from __future__ import annotations

from anna.core.request import Request
from anna.runtime.kv_cache import KVBlock, KVCacheManager
from anna.runtime.state_cache import StateCacheManager


class CacheManagers:
    def __init__(self, kv: KVCacheManager, state: StateCacheManager | None = None) -> None:
        self.kv = kv
        self.state = state

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def shares_prefixes(self) -> bool:
        """Whether a prefix found in the KV cache is all a sequence needs: not when some layers
        keep a state, which a cached prefix does not restore."""
        return self.state is None

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        if not self.shares_prefixes:
            return [], 0
        return self.kv.get_computed_blocks(req)

    def record_prefix_lookup(self, req: Request, num_hit_tokens: int) -> None:
        if self.shares_prefixes:
            self.kv.record_prefix_lookup(req, num_hit_tokens)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[KVBlock] = ()) -> bool:
        """Room for ``num_new_tokens`` more tokens in every kind; False, changing nothing, if a kind
        cannot supply it."""
        had_slot = self.state is None or req.request_id in self.state.slots
        if self.state is not None and not self.state.allocate(req):
            return False
        if not self.kv.allocate_slots(req, num_new_tokens, computed):
            if not had_slot:
                self.state.free(req)
            return False
        return True

    def free(self, req: Request) -> None:
        self.kv.free(req)
        if self.state is not None:
            self.state.free(req)
