"""Eager against torch.compile, and a cold against a warm compile cache, each start in a fresh process.

    python benchmarks/compile_bench.py --model benchmarks/models/qwen2.5-0.5b

Runs, in order: eager; compile (--mode) with an empty cache directory; compile again with the
cache the previous run filled (the "second start"). Each run: the time until the first request
(a 128-token prompt, 16 new tokens) has finished, which includes compilation; then prefill tok/s
of a 512-token prompt and decode tok/s of 128 new tokens (batch 1), median of 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_start(model: str, dtype: str, mode: str, cache_dir: str) -> dict:
    import torch

    from anna import LLM
    from decode_bench import anna_run

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, compile_mode=mode, torchinductor_cache_dir=cache_dir, enable_prefix_caching=False)
    loaded = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)

    def run(prompt_len: int, new: int, rid: str) -> tuple[float, float]:
        return anna_run(llm, torch.randint(3, 700, (prompt_len,), generator=g).tolist(), new, rid)

    t0 = time.perf_counter()
    run(128, 16, "first")
    first = time.perf_counter() - t0
    runs = [run(512, 128, f"r{i}") for i in range(3)]
    return {"mode": mode, "load_s": loaded, "first_request_s": first,
            "prefill_tok_s": 512 / statistics.median(r[0] for r in runs),
            "decode_tok_s": statistics.median(r[1] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mode", default="default")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "CACHE_DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compile_bench.json"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_start(args.model, args.dtype, *args.child)))
        return
    cache = tempfile.mkdtemp(prefix="anna-inductor-")
    results = []
    for label, mode in (("eager", "none"), ("compile, cold cache", args.mode), ("compile, warm cache", args.mode)):
        proc = subprocess.run([sys.executable, __file__, "--model", args.model, "--dtype", args.dtype,
                               "--child", mode, cache], capture_output=True, text=True, check=True)
        row = {"run": label, **json.loads(proc.stdout.strip().splitlines()[-1])}
        print(json.dumps(row))
        results.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
