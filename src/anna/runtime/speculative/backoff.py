"""Automatic back-off: a sequence whose proposals keep being rejected stops proposing for a
while, since every rejected token was verified for nothing (a 1 + K-token step costs more than a
plain decode step: benchmarks/spec_decode_bench.py verify).

A sequence's acceptance is judged over each WINDOW proposed tokens; below the threshold it pauses
(no proposals) for a number of steps that doubles each time, up to MAX_PAUSE, then probes with
proposals of a single token, which cost little more than a plain step; an accepted probe
returns it to full proposals and resets the pause."""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = 8  # proposed tokens over which a sequence's acceptance rate is judged
FIRST_PAUSE = 4  # steps
MAX_PAUSE = 256


@dataclass
class _Record:
    proposed: int = 0
    accepted: int = 0
    pause: int = 0  # steps left without proposals
    next_pause: int = FIRST_PAUSE
    probing: bool = False  # after a pause: single-token proposals until one is accepted


class AcceptanceBackoff:
    def __init__(self, min_rate: float) -> None:
        self.min_rate = min_rate
        self.records: dict[str, _Record] = {}

    def allowed(self, request_id: str, num_tokens: int) -> int:
        """How many tokens the sequence may propose after this step (0 while paused; a paused
        sequence counts a step down)."""
        record = self.records.get(request_id)
        if record is None:
            return num_tokens
        if record.pause:
            record.pause -= 1
            return 0
        return 1 if record.probing else num_tokens

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        if self.min_rate <= 0 or not proposed:
            return
        record = self.records.setdefault(request_id, _Record())
        if record.probing:
            if accepted:
                record.probing, record.next_pause = False, FIRST_PAUSE
            else:
                self._pause(record)
            return
        record.proposed += proposed
        record.accepted += accepted
        if record.proposed < WINDOW:
            return
        if record.accepted < self.min_rate * record.proposed:
            self._pause(record)
            record.probing = True
        else:
            record.next_pause = FIRST_PAUSE
        record.proposed = record.accepted = 0

    @staticmethod
    def _pause(record: _Record) -> None:
        record.pause, record.next_pause = record.next_pause, min(2 * record.next_pause, MAX_PAUSE)

    def forget(self, request_id: str) -> None:
        self.records.pop(request_id, None)
