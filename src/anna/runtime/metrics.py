"""Engine counters: plain integers updated where the events happen, read by the metrics endpoint."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # prompt tokens of accepted requests (n samples count n times)
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> count
    aborted: int = 0
