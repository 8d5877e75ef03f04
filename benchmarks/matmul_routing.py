"""Time every CPU matmul strategy at each M for the shapes of a Qwen2.5-0.5B layer; the
crossovers set the routing defaults (cpu_gemv_max_rows, cpu_upcast_min_rows).

    python benchmarks/matmul_routing.py --out benchmarks/results/matmul_routing.csv

Strategies: torch_native (F.linear in the weight dtype), torch_fp32_upcast (weights converted to
fp32 per call, fp32 GEMM), anna_gemv (Anna's weight-streaming kernel). Each weight set is larger
than the CPU caches, as in a real forward pass.
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from anna.model.cpu_kernels import build_cpu_kernels

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 512]


def timed(fn, weights, x, repeats: int) -> float:
    for w in weights[:2]:
        fn(x, w)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            fn(x, w)
    return (time.perf_counter() - t0) / (repeats * len(weights))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/matmul_routing.csv"))
    ap.add_argument("--cache-dir", default="~/.cache/anna")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels = build_cpu_kernels(args.cache_dir)
    strategies = {
        "torch_native": lambda x, w: F.linear(x.to(dtype), w),
        "torch_fp32_upcast": lambda x, w: F.linear(x, w.float()),
    }
    if kernels is not None:
        strategies["anna_gemv"] = lambda x, w: kernels.gemv(x, w, None)
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, (256 << 20) // (n * k * dtype.itemsize))  # ~256 MiB of weights: beyond the caches
        weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        for m in MS:
            x = torch.randn(m, k)
            for strat, fn in strategies.items():
                if strat == "anna_gemv" and m > 64:
                    continue  # the kernel re-reads W every 8 rows: never a candidate at large M
                repeats = 1 if m >= 128 else 3
                sec = timed(fn, weights, x, repeats)
                rows.append({"shape": name, "n": n, "k": k, "m": m, "strategy": strat, "us": round(sec * 1e6, 1),
                             "weight_gb_s": round(n * k * dtype.itemsize / sec / 1e9, 2)})
                print(f"{name:8s} M={m:4d} {strat:18s} {sec * 1e6:9.1f} us")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        fh.write(f"# {platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtype}\n")
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
