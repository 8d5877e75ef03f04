"""Scheduler bookkeeping per step at many running requests: does it grow with n squared?

No model runs: a Scheduler over a KV block pool decodes N requests (one token each per step);
every step a few requests finish (``remove``) and as many new ones arrive, so that admission,
the running list and removal are all exercised. Prints the mean time per step.

    python benchmarks/scheduler_bench.py --running 64 256
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/scheduler_bench.py   # the same on another version
"""

from __future__ import annotations

import argparse
import time

from anna.core.request import Request
from anna.core.sampling_params import SamplingParams
from anna.runtime.kv_cache import KVCacheManager
from anna.runtime.scheduler import Scheduler, SchedulerConfig

try:
    from anna.runtime.cache_managers import CacheManagers
except ImportError:  # a checkout from before the cache managers: the scheduler takes the KV manager itself
    def CacheManagers(kv):  # noqa: N802
        return kv


def step_time(running: int, steps: int, churn: int, prompt_len: int = 64) -> float:
    kv = KVCacheManager(num_blocks=running * 16, block_size=16, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=running * prompt_len,
                                      long_prefill_token_threshold=prompt_len, prefill_interval_steps=1,
                                      event_driven_prefill_insert=True), CacheManagers(kv))
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    serial = iter(range(10**9))

    def new_request() -> Request:
        i = next(serial)
        return Request(f"r{i}", [(i * 7 + j) % 1000 for j in range(prompt_len)], params)

    for _ in range(running):
        sched.add(new_request())
    elapsed, timed = 0.0, 0
    for step in range(steps + 5):
        start = time.perf_counter()
        batch = sched.schedule()
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            req.append_output_token(step % 1000)
        for req in batch.requests[:churn]:  # the oldest finish, new ones arrive
            sched.remove(req)
            sched.add(new_request())
        if step >= 5:  # the first steps admit everything: not what a running batch costs
            elapsed, timed = elapsed + time.perf_counter() - start, timed + 1
    return elapsed / timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--churn", type=int, default=2, help="requests that finish (and arrive) per step")
    args = ap.parse_args()
    for n in args.running:
        print(f"running={n:4d}: {step_time(n, args.steps, args.churn) * 1e3:8.3f} ms per step")


if __name__ == "__main__":
    main()
