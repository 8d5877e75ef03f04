"""Per-sequence state slots, for the layers whose cache spec is a StateSpec (a recurrent state of
fixed size per sequence, whatever its length), and the state snapshots that let such models reuse
cached prefixes. Bookkeeping only, like kv_cache.py: the runner owns the tensors ([slots, *shape]
per named state tensor, running sequences' slots first, then the snapshots') and copies between
slots when the scheduler's plan says so.

A running sequence holds one slot from its first admission until it finishes or is preempted (a
preempted sequence recomputes its state from the start, as its KV). Allocation failure is a
return value, as for KV blocks. Speculative decoding's checkpoint slots (after the snapshots')
hold the state after each verified token for one step; when a proposal is rejected, the sequence
takes the checkpoint of its last accepted token as its slot and gives its old slot to the
checkpoints, so the numbers of a sequence's slot and of the free ones change, never their count.

Snapshots: a recurrent state cannot be rebuilt from KV blocks, so a prefix found in the KV cache
is only of use with the state the sequence had at its end. The scheduler saves a sequence's state
whenever a prefill chunk ends on a block boundary (and ends a prompt's prefill chunk at its last
block boundary, so that every prompt leaves one), keyed by the hash of the block that ends there;
a later request whose prefix blocks are cached up to such a boundary starts from a copy of that
state. Snapshots are evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict

from anna.core.request import Request


class StateSnapshots:
    def __init__(self, first_slot: int, count: int) -> None:
        self.count = count
        self.free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.reserved: dict[int, bytes] = {}  # slots being written by the current step -> their key

    def find(self, key: bytes) -> int | None:
        slot = self.by_hash.get(key)
        if slot is not None:
            self.by_hash.move_to_end(key)
        return slot

    def reserve(self, key: bytes) -> int | None:
        """A slot to save the state ending at the block ``key`` into (its content is committed by
        ``commit`` after the step); None when it is saved already or being saved."""
        if key in self.by_hash or key in self.reserved.values() or self.count == 0:
            return None
        if self.free:
            slot = self.free.pop()
        elif self.by_hash:
            _, slot = self.by_hash.popitem(last=False)
        else:
            return None  # every snapshot slot is being written by this step
        self.reserved[slot] = key
        return slot

    def commit(self, slot: int) -> None:
        key = self.reserved.pop(slot)
        self.by_hash[key] = slot

    def discard(self, slot: int) -> None:
        """The step that was to write it failed."""
        if self.reserved.pop(slot, None) is not None:
            self.free.append(slot)

    def clear(self) -> int:
        n = len(self.by_hash)
        self.free.extend(self.by_hash.values())
        self.by_hash.clear()
        return n


class StateCacheManager:
    def __init__(self, num_slots: int, num_snapshots: int = 0, num_checkpoints: int = 0) -> None:
        """``num_checkpoints``: speculative decoding's slots (after the snapshots'), where a step
        that verifies proposed tokens keeps the state after each of them, to roll back to."""
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot first
        self.slots: dict[str, int] = {}
        self.snapshots = StateSnapshots(num_slots, num_snapshots)
        self.num_checkpoints = num_checkpoints
        first = num_slots + num_snapshots
        self.free_checkpoints = list(range(first + num_checkpoints - 1, first - 1, -1))

    # ---- speculative decoding's checkpoints: slots a verification step writes a state into ----
    def take_checkpoints(self, n: int) -> list[int]:
        """n free slots for one step (there are always enough: the plan reserves K per sequence
        that may speculate in a step)."""
        taken = self.free_checkpoints[-n:][::-1]
        del self.free_checkpoints[len(self.free_checkpoints) - n:]
        return taken

    def return_checkpoints(self, slots: list[int]) -> None:
        self.free_checkpoints.extend(slots)

    def move(self, request_id: str, slot: int) -> int:
        """The request's state now lives in ``slot`` (a checkpoint that holds the state to keep);
        returns its old slot, which becomes a checkpoint slot in exchange: no state is copied."""
        old, self.slots[request_id] = self.slots[request_id], slot
        return old

    @property
    def total_slots(self) -> int:
        """Slots the runner's state tensors hold: the running sequences', the snapshots' and the
        speculative checkpoints'."""
        return self.num_slots + self.snapshots.count + self.num_checkpoints

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self, req: Request) -> bool:
        """A slot for the request unless it holds one; False when none is free."""
        if req.request_id in self.slots:
            return True
        if not self.free_slots:
            return False
        self.slots[req.request_id] = self.free_slots.pop()
        return True

    def slot(self, request_id: str) -> int:
        return self.slots[request_id]

    def free(self, req: Request) -> None:
        slot = self.slots.pop(req.request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
