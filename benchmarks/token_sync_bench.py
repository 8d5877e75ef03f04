"""The token sync window on this machine: reading tokens back every step (1) against every N.

    python benchmarks/token_sync_bench.py --model benchmarks/models/qwen2.5-0.5b

Two cases, each run with --scheduler-token-sync-every-steps 1 and N, non-streaming requests:
16 concurrent requests of 128 tokens (ignore_eos: no stop, so the window drops nothing), aggregate
tok/s; and one request that stops on a stop token after about 20 tokens (the window may run up to N-1
steps past it), end-to-end latency. Median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from anna import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/token_sync_bench.json"))
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 700, (64,), generator=g).tolist() for _ in range(16)]
    results = {"model": args.model, "threads": torch.get_num_threads(), "runs": {}}
    stop_token = None
    for window in (1, args.window):
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, scheduler_token_sync_every_steps=window)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        if stop_token is None:  # a sampled token (seed 1) of prompt 0 that first appears near the 20th place
            out = llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
            stop_at = next((i for i in range(19, len(out)) if out[i] not in out[:i]), None)
            stop_token = None if stop_at is None else out[stop_at]
            results["stop_after_tokens"] = None if stop_at is None else stop_at + 1
        rates, latencies = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
            if stop_token is not None:
                t0 = time.perf_counter()
                llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=1, max_tokens=100,
                                                          stop_token_ids=[stop_token]), use_tqdm=False)
                latencies.append(time.perf_counter() - t0)
        steps = llm.llm_engine.stats.steps.counts
        results["runs"][f"window_{window}"] = {
            "aggregate_tok_s_16_streams": round(statistics.median(rates), 2),
            "stop_latency_s": round(statistics.median(latencies), 3) if latencies else None,
            "engine_steps": sum(steps.values())}
        print(json.dumps({f"window_{window}": results["runs"][f"window_{window}"]}), flush=True)
        del llm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
