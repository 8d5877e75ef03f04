"""Decode attention over the paged KV cache with Anna's CPU kernel: the time one decode step
spends in attention, for a batch of sequences at a given context length.

    python benchmarks/attention_bench.py --contexts 128 1024

Shapes default to Qwen2.5-0.5B's (14 query heads, 2 KV heads, head dim 64, 24 layers) with 16
sequences; every layer has its own cache, so the KV rows come from memory as in a real step, and
the block tables are shuffled (blocks of a long-running server are not in order). Prints the
best of --repeats steps per context.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from anna.model.attention import kv_cache_shape
from anna.model.cpu_kernels import build_cpu_kernels


def step_ms(kernels, seqs: int, context: int, heads: int, kv_heads: int, dim: int, layers: int, block_size: int,
            repeats: int) -> float:
    blocks = seqs * -(-context // block_size)
    shape = kv_cache_shape(blocks, block_size, kv_heads, dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(layers)]
    tables = torch.randperm(blocks).view(seqs, -1)
    q = torch.randn(seqs, heads, dim)
    lens = torch.full((seqs,), context, dtype=torch.long)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k_cache, v_cache in caches:
            kernels.decode_attention(q, k_cache, v_cache, tables, lens, None, dim ** -0.5)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


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
    args = ap.parse_args()
    kernels = build_cpu_kernels(args.cache_dir)
    if kernels is None:
        raise SystemExit("Anna's CPU kernels could not be built on this machine")
    rows = []
    for context in args.contexts:
        ms = step_ms(kernels, args.seqs, context, args.heads, args.kv_heads, args.head_dim, args.layers,
                     args.block_size, args.repeats)
        kv_mb = args.layers * args.seqs * context * 2 * args.kv_heads * args.head_dim * 4 / 1e6
        rows.append({"context": context, "seqs": args.seqs, "ms_per_step": round(ms, 2), "kv_mb_read": round(kv_mb)})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
