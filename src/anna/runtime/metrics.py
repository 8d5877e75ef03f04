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
# token counts (prompt, generation: 1, 2, 5, 10, ... as vLLM builds them) and tokens per engine step
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5))
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
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

    buckets: tuple[float, ...] = LATENCY_BUCKETS  # (seconds, or tokens for the token histograms)
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
class SpecDecodeStats:
    """Speculative decoding, as vLLM counts it: drafts (sequences that verified proposals in a
    step), draft tokens, accepted tokens, and accepted tokens by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos.extend([0] * (num_proposed - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: the one always sampled plus the accepted ones."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> str:
        return (f"Speculative decoding: drafts={self.num_drafts} draft_tokens={self.num_draft_tokens} "
                f"accepted={self.num_accepted_tokens} acceptance_rate={self.acceptance_rate:.1%} "
                f"mean_acceptance_length={self.mean_acceptance_length:.2f} per_position="
                f"{','.join(str(n) for n in self.accepted_per_pos)}")


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # prompt tokens of accepted requests (n samples count n times)
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> count
    aborted: int = 0
    failed: Counter = field(default_factory=Counter)  # HTTP status (400: its input, 500: Anna's) -> count
    failed_steps: int = 0  # steps whose forward pass failed, failing the requests in them
    steps: StepStats = field(default_factory=StepStats)
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    ttft: Histogram = field(default_factory=Histogram)
    inter_token: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)
    prefill: Histogram = field(default_factory=Histogram)
    decode: Histogram = field(default_factory=Histogram)
    # per finished sequence: its prompt and generated tokens; per finished request: the most tokens
    # one of its samples generated; per step: the tokens it computed
    request_prompt_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    request_generation_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    request_max_generation_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))
