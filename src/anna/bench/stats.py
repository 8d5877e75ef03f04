"""The benchmark's definitions, as pure functions of recorded timings (unit-tested exactly).

- Request decode tok/s ~= (completion_tokens - 1) / (time of last chunk - time of first chunk).
  It is affected by SSE coalescing and multi-token commits; it is not the kernel throughput.
- Concurrent throughput = completion tokens of the group / wall time of the group (prefill included).
- Output TPS = completion tokens / wall time; Input TPS = uncached prompt tokens / wall time;
  Cache TPS = cached prompt tokens / wall time.
- Weighted throughput = Output TPS x 16.796 + Input TPS x 2.799 + Cache TPS x 0.56.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

OUTPUT_WEIGHT, INPUT_WEIGHT, CACHE_WEIGHT = 16.796, 2.799, 0.56

DEFAULT_TARGETS = {
    "output_tps_p10_min": 20.0,  # per-request output tok/s, 10th percentile
    "ttft_p90_max_s": 5.0,
    "cache_hit_rate_min": 0.5,
    "success_rate_min": 0.99,
    "weighted_throughput_min": 8000.0,
}


@dataclass
class RequestRecord:
    scenario: str
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    start: float = 0.0
    first_token: float | None = None  # first non-empty token, reasoning included
    first_content: float | None = None  # first non-empty content token
    last_chunk: float | None = None
    end: float = 0.0
    finish_reason: str | None = None
    output_hash: str = ""
    check: str | None = None  # "pass" / "fail" / None (no check)
    extra: dict = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def ttfc(self) -> float | None:
        return None if self.first_content is None else self.first_content - self.start

    @property
    def completion_time(self) -> float:
        return self.end - self.start

    @property
    def decode_tok_s(self) -> float | None:
        return decode_tok_s(self.completion_tokens, self.first_token, self.last_chunk)


def decode_tok_s(completion_tokens: int, first: float | None, last: float | None) -> float | None:
    if first is None or last is None or completion_tokens < 2 or last <= first:
        return None
    return (completion_tokens - 1) / (last - first)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def group_throughput(records: list[RequestRecord]) -> float | None:
    if not records:
        return None
    wall = max(r.end for r in records) - min(r.start for r in records)
    return sum(r.completion_tokens for r in records) / wall if wall > 0 else None


def load_summary(records: list[RequestRecord], wall: float) -> dict:
    """Aggregates of a load run (only successful requests count towards token rates)."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out = sum(r.completion_tokens for r in ok)
    output_tps, input_tps, cache_tps = out / wall, (prompt - cached) / wall, cached / wall
    per_request = [r.decode_tok_s for r in ok]
    return {
        "requests": len(records), "success_rate": len(ok) / len(records) if records else 0.0,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_s": percentile([r.ttft for r in ok], 50), "ttft_p90_s": percentile([r.ttft for r in ok], 90),
        "ttft_p99_s": percentile([r.ttft for r in ok], 99),
        "request_output_tps_p10": percentile(per_request, 10), "request_output_tps_p50": percentile(per_request, 50),
        "output_tps": output_tps, "input_tps": input_tps, "cache_tps": cache_tps,
        "weighted_throughput": weighted_throughput(output_tps, input_tps, cache_tps), "wall_s": wall,
    }


def weighted_throughput(output_tps: float, input_tps: float, cache_tps: float) -> float:
    return output_tps * OUTPUT_WEIGHT + input_tps * INPUT_WEIGHT + cache_tps * CACHE_WEIGHT


def evaluate_targets(summary: dict, targets: dict) -> dict[str, bool]:
    def at_least(value: float | None, bound: float) -> bool:
        return value is not None and value >= bound

    return {
        "output_tps_p10": at_least(summary["request_output_tps_p10"], targets["output_tps_p10_min"]),
        "ttft_p90": summary["ttft_p90_s"] is not None and summary["ttft_p90_s"] <= targets["ttft_p90_max_s"],
        "cache_hit_rate": at_least(summary["cache_hit_rate"], targets["cache_hit_rate_min"]),
        "success_rate": at_least(summary["success_rate"], targets["success_rate_min"]),
        "weighted_throughput": at_least(summary["weighted_throughput"], targets["weighted_throughput_min"]),
    }
