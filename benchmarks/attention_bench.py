"""Decode attention over the paged KV cache with Anna's CPU kernel: the time one decode step
spends in attention, for a batch of sequences at a given context length.

    python benchmarks/attention_bench.py --contexts 128 1024
    python benchmarks/attention_bench.py --contexts 512 8192 32768 --seqs 1 \
        --kv-cache-dtypes float32 bfloat16 int8 fp8_e4m3 turboquant4 turboquant3

Shapes default to Qwen2.5-0.5B's (14 query heads, 2 KV heads, head dim 64, 24 layers) with 16
sequences; every layer has its own cache, a pool of --pool-blocks blocks from which the sequences'
blocks are drawn at random (blocks of a long-running server are not in order), so the KV rows
come from memory as in a real step. The caches are on huge pages, as the engine keeps them
(--compare-huge-pages: also on small pages, alternated step by step). Prints the best of
--repeats steps per context. --kv-cache-dtypes: caches stored in each of these formats
(model/kv_format.py), timed alternately step by step in the same run. --baseline-kernels: another
build of the kernels (an earlier commit's), alternated with this tree's on the same caches.
--short-context N: the first sequence holds the context, the others N tokens (a long request
beside short ones, which the threads must still share evenly).

    python benchmarks/attention_bench.py --prefill --contexts 512 2048

--prefill: a prompt's causal attention over itself instead (one layer, --contexts tokens): Anna's
kernel (csrc/prefill_attention.c) in fp32 and in bf16 (vdpbf16ps, or AMX tiles on an AMX CPU: run
it on a CPU with AVX512-BF16) against torch's SDPA in fp32 and in bf16 (and --baseline-kernels'
kernel in both), alternated, best of --repeats, in ms per layer and GFLOPS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from anna.model.attention import PagedKV, kv_cache_shape
from anna.model.kv_format import KVFormat
from anna.platforms.cpu.kernels import CpuKernels, build_cpu_kernels
from anna.platforms.cpu.host_memory import huge_page_zeros
from anna.platforms.cpu.isa import detect_isa


def make_caches(shape: tuple[int, ...], layers: int, huge_pages: bool, fmt: KVFormat) -> list[PagedKV]:
    """Random caches stored as ``fmt``, one per layer, on huge pages (as the engine keeps them) or not."""
    stored_shape = (*shape[:-1], fmt.row_width)

    def one() -> torch.Tensor:
        t = huge_page_zeros(stored_shape, fmt.storage_dtype) if huge_pages else torch.empty(stored_shape,
                                                                                            dtype=fmt.storage_dtype)
        return t.copy_(fmt.encode(torch.randn(shape)))
    return [PagedKV(one(), one(), fmt) for _ in range(layers)]


def step_ms(kernels, caches: list[PagedKV], tables: torch.Tensor, q: torch.Tensor, lens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for k_cache, v_cache in caches:
        kernels.decode_attention(q, k_cache, v_cache, caches[0].format, tables, lens, None, q.shape[-1] ** -0.5)
    return (time.perf_counter() - t0) * 1e3


def prefill_rows(kernels, contexts: list[int], heads: int, kv_heads: int, dim: int, repeats: int,
                 baseline: CpuKernels | None = None) -> list[dict]:
    import torch.nn.functional as F

    def sdpa(dtype: torch.dtype):
        def run(q, k, v):
            return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None].to(dtype) for t in (q, k, v)),
                                                  is_causal=True, enable_gqa=True, scale=dim ** -0.5)
        return run

    paths = {"anna_fp32": lambda q, k, v: kernels.causal_attention(q, k, v, dim ** -0.5),
             "anna_bf16": lambda q, k, v: kernels.causal_attention(q, k, v, dim ** -0.5, bf16=True),
             "torch_sdpa_fp32": sdpa(torch.float32), "torch_sdpa_bf16": sdpa(torch.bfloat16)}
    if baseline is not None:
        paths["baseline_fp32"] = lambda q, k, v: baseline.causal_attention(q, k, v, dim ** -0.5)
        paths["baseline_bf16"] = lambda q, k, v: baseline.causal_attention(q, k, v, dim ** -0.5, bf16=True)
    rows = []
    for tokens in contexts:
        q, k, v = (torch.randn(tokens, n, dim) for n in (heads, kv_heads, kv_heads))
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(repeats):
            for name, run in paths.items():
                t0 = time.perf_counter()
                run(q, k, v)
                times[name].append((time.perf_counter() - t0) * 1e3)
        gflop = 2 * 2 * tokens * (tokens + 1) / 2 * heads * dim / 1e9
        rows.append({"tokens": tokens, **{f"{name}_ms": round(min(t), 2) for name, t in times.items()},
                     **{f"{name}_gflops": round(gflop / min(t) * 1e3, 1) for name, t in times.items()}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cache-dir", default="~/.cache/anna", help="where the compiled kernels are kept")
    ap.add_argument("--pool-blocks", type=int, default=4096,
                    help="blocks in each layer's cache (the sequences' blocks are a random subset), as the engine's "
                         "pool (4,096 for 16 x 4,096 tokens)")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["float32"],
                    help="cache formats to time against each other (model/kv_format.py)")
    ap.add_argument("--compare-huge-pages", action="store_true",
                    help="also time caches on small pages, alternated with the huge-page ones")
    ap.add_argument("--baseline-kernels", type=Path,
                    help="a kernel library built from other sources (e.g. an earlier commit's, from its "
                         "--cache-dir's kernels/ folder), timed alternately with this tree's on the same caches")
    ap.add_argument("--short-context", type=int, default=0,
                    help="every sequence but the first holds this many tokens instead (one long request beside "
                         "short ones); 0 = all hold the context")
    ap.add_argument("--prefill", action="store_true", help="a prompt's causal attention instead (see above)")
    ap.add_argument("--cpu-isa", default="auto", help="kernel level (a lower one than the CPU's forces its path; "
                                                      "--baseline-kernels must be a build of the same level)")
    args = ap.parse_args()
    kernels = build_cpu_kernels(args.cache_dir, isa=detect_isa(force=args.cpu_isa))
    if kernels is None:
        raise SystemExit("Anna's CPU kernels could not be built on this machine")
    if args.prefill:
        baseline = CpuKernels(args.baseline_kernels, kernels.level) if args.baseline_kernels else None
        print(json.dumps(prefill_rows(kernels, args.contexts, args.heads, args.kv_heads, args.head_dim,
                                      args.repeats, baseline), indent=1))
        return
    builds = {"ms_per_step": kernels}
    if args.baseline_kernels:
        builds["baseline_ms_per_step"] = CpuKernels(args.baseline_kernels, kernels.level)
    rows = []
    for context in args.contexts:
        blocks = args.seqs * -(-context // args.block_size)
        pool = max(blocks, args.pool_blocks)
        shape = kv_cache_shape(pool, args.block_size, args.kv_heads, args.head_dim)
        tables = torch.randperm(pool)[:blocks].view(args.seqs, -1)
        q = torch.randn(args.seqs, args.heads, args.head_dim)
        lens = torch.full((args.seqs,), args.short_context or context, dtype=torch.long)
        lens[0] = context
        kinds = {}
        for name in args.kv_cache_dtypes:
            fmt = KVFormat(name, args.head_dim)
            kinds[name] = make_caches(shape, args.layers, True, fmt)
            if args.compare_huge_pages:
                kinds[f"{name}_small_pages"] = make_caches(shape, args.layers, False, fmt)
        times = {(kind, build): [] for kind in kinds for build in builds}
        for r in range(args.repeats):
            for kind, caches in kinds.items():
                # each build goes first on every other repeat: at short contexts the caches fit in L3,
                # and the second step over them would otherwise always be the warm one
                for build, lib in (list(builds.items())[::-1] if r % 2 else builds.items()):
                    times[kind, build].append(step_ms(lib, caches, tables, q, lens))
        row = {"context": context, "seqs": args.seqs}
        for kind, caches in kinds.items():
            kv_mb = args.layers * int(lens.sum()) * 2 * args.kv_heads * caches[0].format.row_bytes / 1e6
            row[kind] = {"kv_mb_read": round(kv_mb, 1)}
            row[kind].update({build: round(min(times[kind, build]), 2) for build in builds})
        if args.compare_huge_pages:
            for name in args.kv_cache_dtypes:
                ratios = [s / h for s, h in zip(times[f"{name}_small_pages", "ms_per_step"],
                                                times[name, "ms_per_step"])]
                row[name]["huge_pages_speedup_median"] = round(statistics.median(ratios), 3)
        rows.append(row)
        del kinds
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
