"""Per-sequence state slots, for the layers whose cache spec is a StateSpec (a recurrent state of
fixed size per sequence, whatever its length). Bookkeeping only, like kv_cache.py: the runner
owns the tensors ([slots, *shape] per named state tensor) and reads a request's slot here.

A running sequence holds one slot from its first admission until it finishes or is preempted (a
preempted sequence recomputes its state from the start, as its KV). Allocation failure is a
return value, as for KV blocks.
"""

from __future__ import annotations

from anna.core.request import Request


class StateCacheManager:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot first
        self.slots: dict[str, int] = {}

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
