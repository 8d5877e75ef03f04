"""Time to first token of the first requests after start, with and without the warmup table.

    python benchmarks/warmup_bench.py --model benchmarks/models/qwen2.5-0.5b

For each mode a fresh engine is built; then 10 requests (distinct random 64-token prompts,
1 new token) run one after another, and the TTFT of each is recorded. A warmed-up engine should
show no spike on the first request compared with the tenth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from anna import LLM, SamplingParams
from anna.runtime.warmup import run_warmup


def ttfts(llm: LLM, n: int, seed: int) -> list[float]:
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 700, (64,), generator=g).tolist()
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/warmup_bench.json"))
    args = ap.parse_args()
    results = {}
    for mode in ("no_warmup", "warmup"):
        llm = LLM(args.model, dtype="bfloat16", max_model_len=4096)
        warm_s = None
        if mode == "warmup":
            t0 = time.perf_counter()
            run_warmup(llm.llm_engine)
            warm_s = time.perf_counter() - t0
        times = ttfts(llm, args.requests, seed=1)
        results[mode] = {"warmup_s": warm_s, "ttft_s": [round(t, 4) for t in times],
                         "first_over_tenth": round(times[0] / times[-1], 2)}
        print(mode, results[mode], flush=True)
        del llm
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
