"""Automatic back-off: a sequence whose proposals keep being rejected stops proposing for a
while, since every verified token that is rejected costs compute (little on a CPU, where a step
is bound by reading the weights; more on a large batch). The pause doubles each time the rate is
still low after it, up to MAX_PAUSE steps, and a good window ends it."""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = 8  # verified proposals over which a sequence's acceptance rate is judged
MAX_PAUSE = 64  # steps


@dataclass
class _Record:
    proposed: int = 0
    accepted: int = 0
    pause: int = 0  # steps left without proposals
    next_pause: int = 4


class AcceptanceBackoff:
    def __init__(self, min_rate: float) -> None:
        self.min_rate = min_rate
        self.records: dict[str, _Record] = {}

    def allows(self, request_id: str) -> bool:
        """Whether the sequence may propose after this step (a paused one counts a step down)."""
        record = self.records.get(request_id)
        if record is None or record.pause == 0:
            return True
        record.pause -= 1
        return False

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        if self.min_rate <= 0 or not proposed:
            return
        record = self.records.setdefault(request_id, _Record())
        record.proposed += proposed
        record.accepted += accepted
        if record.proposed < WINDOW:
            return
        if record.accepted < self.min_rate * record.proposed:
            record.pause, record.next_pause = record.next_pause, min(2 * record.next_pause, MAX_PAUSE)
        else:
            record.next_pause = 4
        record.proposed = record.accepted = 0

    def forget(self, request_id: str) -> None:
        self.records.pop(request_id, None)
