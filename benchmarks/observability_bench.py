"""What observability costs, and where a decode step's time goes.

    python benchmarks/observability_bench.py --model benchmarks/models/qwen2.5-0.5b

1. Always-on observability (step classes, EWMA spike check, latency histograms): batch-1 decode
   tok/s with it as shipped versus with its recording replaced by no-ops (A/B/B/A runs), and the
   recording's own cost per step timed in isolation, as a share of the step time.
2. --profile-runtime: decode tok/s with it on versus off (on also turns off the fused CPU path).
3. The decode phase breakdown at batch 1 from --profile-runtime, for each --formats entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from anna import LLM, SamplingParams
from decode_bench import anna_run


def decode_speed(llm: LLM, prompt: list[int], tokens: int, tag: str) -> float:
    return anna_run(llm, prompt, tokens, tag)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--formats", default="none,int4")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/observability_bench.json"))
    args = ap.parse_args()
    prompt = torch.randint(3, 700, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    results: dict = {"model": args.model, "threads": torch.get_num_threads()}

    llm = LLM(args.model, dtype="bfloat16", enable_prefix_caching=False)
    engine = llm.llm_engine
    decode_speed(llm, prompt, 8, "warm")
    shipped_stats = engine.stats

    class NoStats:  # the same interface, recording nothing
        def __getattr__(self, name):
            return getattr(shipped_stats, name)

    noop = NoStats()
    noop.steps = type("S", (), {"record": staticmethod(lambda *a: None), "summary": shipped_stats.steps.summary})()
    for h in ("ttft", "inter_token", "e2e", "queue", "prefill", "decode"):
        setattr(noop, h, type("H", (), {"observe": staticmethod(lambda v: None)})())
    on, off = [], []
    for i in range(args.pairs):
        for stats in ((shipped_stats, noop) if i % 2 == 0 else (noop, shipped_stats)):
            engine.scheduler.stats = stats
            (on if stats is shipped_stats else off).append(decode_speed(llm, prompt, args.new_tokens, f"ab{i}"))
    engine.scheduler.stats = shipped_stats
    # the recording done per decode step, in isolation: one step record, one inter-token observation
    from anna.runtime.metrics import EngineStats
    from anna.runtime.scheduler import StepClass
    probe = EngineStats()
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        probe.steps.record(StepClass.PURE_DECODE, 0.05)
        probe.inter_token.observe(0.05)
    per_step = (time.perf_counter() - t0) / n
    step_s = 1 / statistics.median(on)
    results["always_on"] = {"tok_s_with": statistics.median(on), "tok_s_without": statistics.median(off),
                            "ab_difference_pct": round(100 * (1 - statistics.median(on) / statistics.median(off)), 2),
                            "recording_us_per_step": round(per_step * 1e6, 2),
                            "recording_share_of_step_pct": round(100 * per_step / step_s, 4)}
    print("always-on observability:", results["always_on"], flush=True)
    plain_speed = statistics.median(on)
    del llm, engine

    results["breakdown"] = {}
    for fmt in args.formats.split(","):
        llm = LLM(args.model, dtype="bfloat16", quantization=fmt, enable_prefix_caching=False, profile_runtime=True)
        engine = llm.llm_engine
        decode_speed(llm, prompt, 8, "warm")
        engine.add_request("prof", prompt, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
        engine.step()  # the prefill and the first token
        profiler = engine.profiler
        profiler.reset()  # count decode steps only
        t0 = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        speed = steps / (time.perf_counter() - t0)
        report = profiler.report()
        results["breakdown"][fmt] = {"tok_s_profiled": speed, "report": report}
        print(fmt, f"{speed:.2f} tok/s profiled;", profiler.table(), flush=True)
        del llm
    results["profile_runtime"] = {"tok_s_off": plain_speed, "tok_s_on": results["breakdown"]["none"]["tok_s_profiled"]
                                  if "none" in results["breakdown"] else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
