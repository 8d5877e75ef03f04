"""Two builds of Anna's CPU matmul kernels alternated in one process: a git revision's (--base)
against the working tree's, on the matmuls of a Qwen2.5-0.5B layer and its lm_head.

    python benchmarks/kernel_ab.py --base HEAD~1 --ms 1,4,16,64
    python benchmarks/kernel_ab.py --base HEAD~1 --quantization int4 --ms 1,16
    python benchmarks/kernel_ab.py --base HEAD~1 --quantization int8 --int8-group-size 32 --ms 1,16
    python benchmarks/kernel_ab.py --base HEAD~1 --large-m --ms 128,512 --rounds 3
    python benchmarks/kernel_ab.py --base main --large-m --amx-emulated --ms 600 --rounds 1

This VM class's speed wanders by a third between runs, so two builds are only compared within one
process, round by round, in alternating order: each round times every weight copy once with each
build. Each shape has enough copies of its weight that they stream from memory, as in a decode
step (the lm_head, 0.27 GB in bf16, is its own). Prints, per shape and M, the median time per
matmul of each build, the rate, and base / this tree (above 1: the working tree is faster), and
checks that both builds give the same result to 1e-5 of its largest value. Both revisions must call
the kernels with the same arguments (anna_gemv's and anna_qgemm's C signatures) and read the
weights in this tree's layout (int4: revisions from f33805f on, where a unit's two blocks
alternate; int8: from the commit that put it in row lanes on); bf16 weights run in fp32 arithmetic with the built-in routing bounds unless
--bf16-pair-max-rows or --bf16-dot-min-rows (vdpbf16ps from that M on) says otherwise.
--large-m times the large-M GEMM of bf16 weights instead (a prefill's matmuls past
cpu_gemv_max_rows): the avx2 level's (csrc/panel_matmul.c) or the amx level's on AMX tiles
(csrc/tile_matmul.c); both revisions must have it. --amx-emulated builds both revisions at the amx
level with the tile instructions emulated in C (csrc/amx_tiles.h), on any AVX-512 VNNI CPU: its
timings say nothing of an AMX CPU, but the check that the two builds agree still holds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from anna.model.linear import interleave_rows, quantized_for_cpu_kernel
from anna.model.quantization import quantize_int4, quantize_int8
from anna.platforms.base import BF16_PAIR_MAX_ROWS
from anna.platforms.cpu import keep_freed_memory
from anna.platforms.cpu.isa import detect_isa
from anna.platforms.cpu.kernels import (AMX_EMULATED_CFLAGS, KERNEL_DIR, LEVEL_CFLAGS, kernel_build_level, load_kernels,
                                        request_amx_tiles)

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "lm_head": (151936, 896)}
STREAMED_BYTES = 160 << 20  # weight copies per shape: well past the last-level cache


def base_sources(rev: str, into: Path) -> Path:
    """The kernel sources (csrc/) as they were at ``rev``."""
    repo = Path(__file__).resolve().parent.parent
    folder = KERNEL_DIR.relative_to(repo)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, str(folder)], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision whose kernels are the baseline")
    ap.add_argument("--quantization", choices=["none", "int8", "int4"], default="none", help="none: bf16 weights")
    ap.add_argument("--int4-group-size", type=int, default=32)
    ap.add_argument("--int8-group-size", type=int, default=0, help="0: a scale per row")
    ap.add_argument("--ms", default="1,4,16,64", help="rows of x, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cpu-isa", default="auto", help="the kernel level both builds are built for")
    ap.add_argument("--bf16-pair-max-rows", type=int, default=BF16_PAIR_MAX_ROWS,
                    help="bf16 weights widened in registers up to this M (the avx2 level; cpu_bf16_pair_max_rows)")
    ap.add_argument("--bf16-dot-min-rows", type=int, default=0,
                    help="bf16 weights on vdpbf16ps from this M on, where the CPU has AVX512-BF16 "
                         "(cpu_bf16_dot_min_rows); 0: never")
    ap.add_argument("--large-m", action="store_true",
                    help="the large-M GEMM (avx2: anna_panel_matmul; amx: anna_tile_matmul) instead of the "
                         "weight-streaming kernel")
    ap.add_argument("--amx-emulated", action="store_true",
                    help="both revisions at the amx level with emulated tiles (agreement only; the timings mean nothing)")
    ap.add_argument("--cache-dir", default="~/.cache/anna")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    keep_freed_memory()  # as the engine runs: large outputs reuse freed memory, not fresh pages

    isa = detect_isa(force=args.cpu_isa)
    level = kernel_build_level(isa)
    if level is None:
        raise SystemExit(f"no kernel level on {isa.model_name}")
    flags, name = LEVEL_CFLAGS[level], level
    if args.amx_emulated:
        if not isa.has("avx512_vnni"):
            raise SystemExit(f"--amx-emulated: {isa.model_name} has no AVX-512 VNNI")
        level, flags, name = "amx", AMX_EMULATED_CFLAGS, "amx_emulated"
    elif level == "amx" and (refused := request_amx_tiles()):
        raise SystemExit(f"Linux did not grant the AMX tiles ({os.strerror(refused)}): try --cpu-isa avx512_vnni")
    if args.large_m and (level not in ("avx2", "amx") or args.quantization != "none"):
        raise SystemExit("--large-m: the avx2 or amx level's GEMM of bf16 weights (--cpu-isa avx2 or an AMX CPU, "
                         "no --quantization)")
    with tempfile.TemporaryDirectory() as tmp:
        base = load_kernels(args.cache_dir, "", level, flags, name=f"{name}_base",
                            source_dir=base_sources(args.base, Path(tmp)))
    tree = load_kernels(args.cache_dir, "", level, flags, name=name)
    if base is None or tree is None:
        raise SystemExit("a build failed (see the warning above)")

    def make(n: int, k: int):
        w = torch.randn(n, k)
        if args.quantization == "int4":
            return quantized_for_cpu_kernel(1, *quantize_int4(w, args.int4_group_size))
        if args.quantization == "int8":
            return quantized_for_cpu_kernel(0, *quantize_int8(w, args.int8_group_size))
        return interleave_rows(w.to(torch.bfloat16))

    def run(kernels, x, w):
        if args.quantization != "none":
            kind, group = (1, args.int4_group_size) if args.quantization == "int4" else (0, args.int8_group_size)
            return kernels.qgemm(x, w[0], w[1], kind, group, None)
        if args.large_m:
            return kernels.tile_matmul(x, w, None) if level == "amx" else kernels.panel_matmul(x, w, None)
        return kernels.gemv(x, w, None, args.bf16_dot_min_rows, args.bf16_pair_max_rows)

    bytes_per_weight = {"int4": 0.5, "int8": 1}.get(args.quantization, 2)
    results = {"cpu": isa.model_name, "level": level, "threads": torch.get_num_threads(), "torch": torch.__version__,
               "machine": platform.machine(), "base": args.base, "quantization": args.quantization,
               "bf16_dot_min_rows": args.bf16_dot_min_rows, "large_m": args.large_m,
               "amx_emulated": args.amx_emulated, "rows": []}
    print(f"{isa.model_name}, kernel level {level}{' (tiles emulated)' if args.amx_emulated else ''}, "
          f"{torch.get_num_threads()} threads; base {args.base}")
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(1, int(STREAMED_BYTES // (n * k * bytes_per_weight)))
        weights = [make(n, k) for _ in range(copies)]
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k)
            want, got = run(base, x, weights[0]), run(tree, x, weights[0])
            scale = want.abs().max().item()
            if (want - got).abs().max().item() > 1e-5 * scale:
                raise SystemExit(f"{name} M={m}: the builds disagree by {(want - got).abs().max().item():.3g} "
                                 f"(largest value {scale:.3g})")
            times: dict[str, list[float]] = {"base": [], "tree": []}
            for r in range(args.rounds):
                order = (("base", base), ("tree", tree)) if r % 2 == 0 else (("tree", tree), ("base", base))
                for tag, kernels in order:
                    t0 = time.perf_counter()
                    for w in weights:
                        run(kernels, x, w)
                    times[tag].append((time.perf_counter() - t0) / len(weights))
            b, t = statistics.median(times["base"]), statistics.median(times["tree"])
            ops = 2 * m * n * k / 1e9
            row = {"shape": name, "n": n, "k": k, "m": m, "base_us": round(b * 1e6, 1), "tree_us": round(t * 1e6, 1),
                   "base_gops": round(ops / b, 1), "tree_gops": round(ops / t, 1), "speedup": round(b / t, 3)}
            results["rows"].append(row)
            print(f"{name:8s} M={m:4d}  base {row['base_us']:9.1f} us ({row['base_gops']:6.1f} G/s)  "
                  f"tree {row['tree_us']:9.1f} us ({row['tree_gops']:6.1f} G/s)  x{row['speedup']:.2f}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
