"""Engine counters, latency histograms and step classes: plain numbers updated where events
happen (a few operations per step), read by the metrics endpoint and the periodic log line."""

from __future__ import annotations

import bisect
import enum
import logging
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
SPIKE_FACTOR = 3.0  # a step longer than this times its class's rolling mean is a spike
EWMA_ALPHA = 0.1
SPIKE_WARMUP_STEPS = 8  # steps of a class seen before spikes are judged


class StepClass(enum.Enum):
    """What a step ran, as the scheduler classifies it (steps are timed and counted per class)."""

    PURE_DECODE = "pure"
    PREFILL_INSERT = "+prefill_insert"  # decodes plus a newly admitted request's prefill
    BUDGET_RECOMPUTE = "+budget_recompute"  # decodes plus a continuing prefill chunk or a recompute
    PREFILL_ONLY = "prefill_only"


@dataclass
class Histogram:
    """Cumulative-bucket histogram in Prometheus' sense (buckets are upper bounds, in seconds)."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, c in zip(self.buckets, self.counts):
            running += c
            out.append((repr(bound), running))
        out.append(("+Inf", self.count))
        return out


@dataclass
class StepStats:
    """Per step class: how many steps, their rolling mean time, and spikes."""

    counts: Counter = field(default_factory=Counter)
    ewma: dict[StepClass, float] = field(default_factory=dict)
    spikes: int = 0

    def record(self, step_class: StepClass, seconds: float) -> None:
        self.counts[step_class] += 1
        mean = self.ewma.get(step_class)
        if mean is not None and self.counts[step_class] > SPIKE_WARMUP_STEPS and seconds > SPIKE_FACTOR * mean:
            self.spikes += 1
            log.warning("decode step spike: %.1f ms (rolling mean %.1f ms, class %s)", seconds * 1e3, mean * 1e3,
                        step_class.value)
        self.ewma[step_class] = seconds if mean is None else (1 - EWMA_ALPHA) * mean + EWMA_ALPHA * seconds

    def summary(self) -> str:
        c = self.counts
        return (f"Decode step classes: pure={c[StepClass.PURE_DECODE]} "
                f"+prefill_insert={c[StepClass.PREFILL_INSERT]} +budget_recompute={c[StepClass.BUDGET_RECOMPUTE]} "
                f"prefill_only={c[StepClass.PREFILL_ONLY]} spikes={self.spikes}")


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # prompt tokens of accepted requests (n samples count n times)
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> count
    aborted: int = 0
    failed: Counter = field(default_factory=Counter)  # HTTP status (400: its input, 500: Anna's) -> count
    failed_steps: int = 0  # steps whose forward pass failed, failing the requests in them
    steps: StepStats = field(default_factory=StepStats)
    ttft: Histogram = field(default_factory=Histogram)
    inter_token: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    prefill: Histogram = field(default_factory=Histogram)
    decode: Histogram = field(default_factory=Histogram)
