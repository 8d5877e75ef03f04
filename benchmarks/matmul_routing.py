"""Time every CPU matmul strategy at each M for the shapes of a Qwen2.5-0.5B layer; the
crossovers set the routing defaults (cpu_gemv_max_rows, cpu_upcast_min_rows).

    python benchmarks/matmul_routing.py --out benchmarks/results/matmul_routing.csv

    python benchmarks/matmul_routing.py --quantization int4 --int4-group-size 32 \
        --out benchmarks/results/matmul_routing_int4_g32.csv

Strategies: torch_native (F.linear in the weight dtype), torch_fp32_upcast (weights converted to
fp32 per call, fp32 GEMM), anna_gemv (Anna's weight-streaming kernel, converting each block of a
half weight to fp32), anna_gemv_bf16_dot (the same kernel on bf16 dot products, bf16 weights on a CPU
with AVX512-BF16), anna_gemv_bf16_pairs (the same kernel widening bf16 weights in registers, the
avx2 level). With --quantization:
packed (Anna's kernel reading int8/int4), dequant (unpack to fp32, then a dense GEMM) and
dequant_bf16 (the same GEMM in bf16, as on CPUs with AVX512-BF16 or AMX). Each
weight set is larger than the CPU caches, as in a real forward pass.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from anna.platforms.cpu.isa import detect_isa
from anna.platforms.cpu.kernels import build_cpu_kernels
from anna.model.linear import interleave_rows, quantized_for_cpu_kernel
from anna.model.quantization import quantize_int4, quantize_int8

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048]  # 2048: the default token budget of a step


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
    ap.add_argument("--quantization", choices=["none", "int8", "int4"], default="none")
    ap.add_argument("--int4-group-size", type=int, default=32)
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="The M values to time, comma-separated.")
    ap.add_argument("--cpu-isa", default="auto", help="The kernel level Anna's kernels are built for (a lower one "
                                                      "than the CPU's: that level's build)")
    ap.add_argument("--strategies", default="", help="Only these strategies, comma-separated (default: all).")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels = build_cpu_kernels(args.cache_dir, isa=detect_isa(force=args.cpu_isa))
    quant = args.quantization
    kind, group = (0, 0) if quant == "int8" else (1, args.int4_group_size)
    if quant != "none":
        if kernels is None:
            raise SystemExit("the quantized strategies need Anna's CPU kernels")
        strategies = {
            "packed": lambda x, w: kernels.qgemm(x, w[0], w[1], kind, group, None),
            "dequant": lambda x, w: F.linear(x, kernels.dequant(w[0], w[1], kind, group, x.shape[-1])),
            # what a bf16 model runs on a CPU with hardware bf16 (--cpu-isa avx512_bf16 or amx)
            "dequant_bf16": lambda x, w: F.linear(x.to(torch.bfloat16), kernels.dequant(
                w[0], w[1], kind, group, x.shape[-1], dtype=torch.bfloat16)).float(),
        }
    else:
        strategies = {
            "torch_native": lambda x, w: F.linear(x.to(dtype), w[0]),
            "torch_fp32_upcast": lambda x, w: F.linear(x, w[0].float()),
        }
        if kernels is not None:  # w[1]: the same weight with rows interleaved, as the kernel reads it
            strategies["anna_gemv"] = lambda x, w: kernels.gemv(x, w[1], None)
            if dtype == torch.bfloat16 and kernels.widens_bf16_pairs:
                # bf16 weights widened in registers at every M from 4 (cpu_bf16_pair_max_rows)
                strategies["anna_gemv_bf16_pairs"] = lambda x, w: kernels.gemv(x, w[1], None, bf16_pair_max_rows=1 << 30)
            if dtype == torch.bfloat16 and kernels.level != "avx2" and detect_isa(force=args.cpu_isa).bf16_matmul:
                # bf16 weights times x rounded to bf16 on vdpbf16ps (cpu_bf16_dot_min_rows)
                strategies["anna_gemv_bf16_dot"] = lambda x, w: kernels.gemv(x, w[1], None, bf16_dot_rows=1)
    if args.strategies:
        strategies = {name: fn for name, fn in strategies.items() if name in args.strategies.split(",")}
    bytes_per_weight = {"none": dtype.itemsize, "int8": 1, "int4": 0.5}[quant]

    def make(n: int, k: int):
        w = torch.randn(n, k)
        if quant != "none":  # values and scales as the kernels read them (QuantLinear.interleave_for_cpu_kernel)
            kind = 0 if quant == "int8" else 1
            return quantized_for_cpu_kernel(kind, *(quantize_int8(w) if kind == 0 else quantize_int4(w, group)))
        w = w.to(dtype)
        return w, interleave_rows(w)

    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, int((256 << 20) // (n * k * bytes_per_weight)))  # ~256 MiB of weights (per layout)
        weights = [make(n, k) for _ in range(copies)]
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k)
            for strat, fn in strategies.items():
                if strat.startswith("anna_gemv") and m > 256:
                    continue  # the kernel re-reads W once per group of x rows: never a candidate at large M
                repeats = 1 if m >= 128 else 3
                # large M is arithmetic-bound: a few copies suffice (the rest measure memory traffic)
                sec = timed(fn, weights if m < 512 else weights[:4], x, repeats)
                rows.append({"shape": name, "n": n, "k": k, "m": m, "strategy": strat, "us": round(sec * 1e6, 1),
                             "weight_gb_s": round(n * k * bytes_per_weight / sec / 1e9, 2)})
                print(f"{name:8s} M={m:4d} {strat:18s} {sec * 1e6:9.1f} us")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        what = args.dtype if quant == "none" else f"{quant}" + (f" group {group}" if quant == "int4" else "")
        fh.write(f"# {detect_isa().model_name}, kernel level {kernels.level if kernels else 'none'}, "
                 f"{torch.get_num_threads()} threads, torch {torch.__version__}, {what}\n")
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
