"""One cache manager per kind of cache the model declares (model/cache_spec.py), behind the one
interface the scheduler allocates through: paged KV blocks (kv_cache.py) for attention layers
and per-sequence state slots (state_cache.py) for recurrent ones.

A prefix hit of a model with both kinds needs the cached KV blocks and a state snapshot taken
where they end: lookups stop at the longest such prefix, and the hit says which snapshot to copy
into the sequence's slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from anna.core.request import Request
from anna.runtime.kv_cache import KVBlock, KVCacheManager
from anna.runtime.state_cache import StateCacheManager


@dataclass
class PrefixHit:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0
    state_snapshot: int | None = None  # the snapshot slot holding the state at the prefix's end


@dataclass(frozen=True)
class StateCopy:
    """Copy one state slot into another: a snapshot into a sequence's slot before the step
    (a prefix hit), or a sequence's slot into a snapshot after it (a save)."""

    src: int
    dst: int


class CacheManagers:
    def __init__(self, kv: KVCacheManager, state: StateCacheManager | None = None) -> None:
        self.kv = kv
        self.state = state

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def snapshots_state(self) -> bool:
        """Whether states are saved at block boundaries (prefix reuse for recurrent layers)."""
        return self.state is not None and self.state.snapshots.count > 0 and self.kv.enable_prefix_caching

    @property
    def shares_prefixes(self) -> bool:
        """Whether a prefix found in the caches is all a sequence needs: with recurrent layers,
        only when their states are snapshotted at the prefix's end."""
        return self.state is None or self.snapshots_state

    def get_computed_blocks(self, req: Request) -> PrefixHit:
        if not self.shares_prefixes:
            return PrefixHit()
        blocks, num_tokens = self.kv.get_computed_blocks(req)
        if self.state is None or not blocks:
            return PrefixHit(blocks, num_tokens)
        hashes = self.kv.block_hashes(req, num_tokens)
        for n in range(len(blocks), 0, -1):  # the longest cached prefix whose state was saved
            slot = self.state.snapshots.find(hashes[n - 1])
            if slot is not None:
                return PrefixHit(blocks[:n], n * self.block_size, slot)
        return PrefixHit()

    def record_prefix_lookup(self, req: Request, num_hit_tokens: int) -> None:
        if self.shares_prefixes:
            self.kv.record_prefix_lookup(req, num_hit_tokens)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[KVBlock] = (),
                       num_lookahead_tokens: int = 0) -> bool:
        """Room for ``num_new_tokens`` more tokens (and ``num_lookahead_tokens`` KV slots beyond
        them, for a speculative proposer) in every kind; False, changing nothing, if a kind
        cannot supply it."""
        had_slot = self.state is None or req.request_id in self.state.slots
        if self.state is not None and not self.state.allocate(req):
            return False
        if not self.kv.allocate_slots(req, num_new_tokens, computed, num_lookahead_tokens):
            if not had_slot:
                self.state.free(req)
            return False
        return True

    def restore(self, req: Request, hit: PrefixHit) -> StateCopy | None:
        """The copy that gives an admitted request the state at the end of its prefix hit."""
        if hit.state_snapshot is None:
            return None
        return StateCopy(hit.state_snapshot, self.state.slot(req.request_id))

    def waits_for_leader(self, req: Request) -> bool:
        """Whether a sample of an n > 1 request should wait for its first sample's prompt prefill,
        to start from the state snapshot that leaves (where states are snapshotted; without
        recurrent layers the samples share blocks registered in the same step)."""
        leader = req.prefix_leader
        if leader is None or self.state is None or not self.snapshots_state or req.num_computed_tokens:
            return False
        last = (req.num_prompt_tokens - 1) // self.block_size * self.block_size
        return not leader.is_finished and leader.num_computed_tokens < last

    def snapshot_boundary(self, req: Request, start: int, num_new_tokens: int) -> int:
        """Where a prefill chunk of the request from ``start`` should end so that its state is
        saved at the prompt's last block boundary (some of the prompt is always left after it,
        to sample from): ``start + num_new_tokens`` or earlier."""
        end = start + num_new_tokens
        if not self.snapshots_state or num_new_tokens <= 1:
            return end
        bs = self.block_size
        last = (req.num_prompt_tokens - 1) // bs * bs
        return last if start < last < end else end

    def plan_save(self, req: Request, start: int, num_new_tokens: int) -> StateCopy | None:
        """A save of the request's state after this step when its prefill chunk ends on a block
        boundary whose tokens are known and whose state is not saved yet."""
        end = start + num_new_tokens
        if not self.snapshots_state or num_new_tokens <= 1 or end % self.block_size or not req.register_prefix_blocks:
            return None
        hashes = self.kv.block_hashes(req, end)
        if len(hashes) * self.block_size < end:
            return None
        slot = self.state.snapshots.reserve(hashes[end // self.block_size - 1])
        return None if slot is None else StateCopy(self.state.slot(req.request_id), slot)

    def saved(self, copy: StateCopy, ok: bool) -> None:
        """After the step: keep the snapshot, or (the step failed for it) give the slot back."""
        if ok:
            self.state.snapshots.commit(copy.dst)
        else:
            self.state.snapshots.discard(copy.dst)

    def free(self, req: Request) -> None:
        self.kv.free(req)
        if self.state is not None:
            self.state.free(req)

    def reset_prefix_cache(self) -> int:
        if self.state is not None:
            self.state.snapshots.clear()
        return self.kv.reset_prefix_cache()
