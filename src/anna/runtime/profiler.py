"""--profile-runtime: where the time of a step goes, region by region (diagnosis only).

Layers wrap their work in ``profiler.region(name)``; on an asynchronous device each region is
synchronized so that its time is its own. The engine adds the host-side gap between steps
(``cpu_launch_gap``) and sampling. It costs time (synchronisation, and the fused CPU decode path
is off while profiling so that regions are visible), so it is off by default.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

from anna.platforms import Platform


class RuntimeProfiler:
    def __init__(self, platform: Platform) -> None:
        self.sync = platform.synchronize if platform.asynchronous else None
        self.reset()

    def reset(self) -> None:
        """Count from the next step on (a benchmark leaves out its warm-up or a phase it does not time)."""
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps = 0
        self.step_time = 0.0
        self._last_step_end: float | None = None

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        if self.sync:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.total[name] += time.perf_counter() - start
            self.calls[name] += 1

    def step_started(self) -> float:
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.total["cpu_launch_gap"] += now - self._last_step_end
            self.calls["cpu_launch_gap"] += 1
        return now

    def step_finished(self, started: float) -> None:
        now = time.perf_counter()
        self.steps += 1
        self.step_time += now - started
        self._last_step_end = now

    def report(self) -> dict:
        """Share of step time per region (nested regions are not double-counted: layers time leaves)."""
        step_time = self.step_time or 1e-12
        regions = {name: {"total_ms": round(t * 1e3, 3), "calls": self.calls[name],
                          "share_of_step": round(t / step_time, 4)}
                   for name, t in sorted(self.total.items(), key=lambda kv: -kv[1])}
        covered = sum(t for n, t in self.total.items() if n != "cpu_launch_gap")
        gap = self.total.get("cpu_launch_gap", 0.0)
        return {"steps": self.steps, "step_ms_mean": round(self.step_time / max(1, self.steps) * 1e3, 3),
                "cpu_launch_gap_ms_mean": round(gap / max(1, self.calls.get("cpu_launch_gap", 0)) * 1e3, 3),
                "other_share_of_step": round(max(0.0, 1 - covered / step_time), 4), "regions": regions}

    def table(self) -> str:
        r = self.report()
        parts = [f"{name} {v['share_of_step'] * 100:.1f}%" for name, v in r["regions"].items()]
        return (f"Runtime profile over {r['steps']} steps (mean {r['step_ms_mean']} ms, host gap "
                f"{r['cpu_launch_gap_ms_mean']} ms): " + " | ".join(parts) + f" | other {r['other_share_of_step'] * 100:.1f}%")
