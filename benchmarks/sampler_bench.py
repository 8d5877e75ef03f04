"""Time of one sampler call over a batch of logits, for the sampling mixes a server sees.

    python benchmarks/sampler_bench.py --vocab 151936 --rows 16
    python benchmarks/sampler_bench.py --vocab 151936 --rows 16 --cpu-kernels

Mixes: all greedy (one argmax), all sampled (temperature, top_p, top_k), and sampled with
penalties and bad words (the per-row path). Median of --repeats calls after a warm-up call.
--cpu-kernels: all-greedy batches through Anna's CPU kernel argmax, as the engine runs them on CPU
(else torch's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from anna.core.request import Request
from anna.core.sampling_params import SamplingParams
from anna.runtime.sampler import Sampler

MIXES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_p=0.9, top_k=50, seed=1),
    "penalized": dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, seed=1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--cpu-kernels", action="store_true", help="greedy batches on Anna's CPU kernel argmax")
    ap.add_argument("--cache-dir", default="~/.cache/anna", help="where the CPU kernels are built")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab)
    argmax = None
    if args.cpu_kernels:
        from anna.platforms.cpu.kernels import build_cpu_kernels

        kernels = build_cpu_kernels(args.cache_dir)
        if kernels is None:
            raise SystemExit("Anna's CPU kernels could not be built here")
        argmax = kernels.argmax
    out = {"vocab": args.vocab, "rows": args.rows, "threads": 2, "cpu_kernels": args.cpu_kernels}
    for name, kw in MIXES.items():
        reqs = []
        for i in range(args.rows):
            r = Request(f"r{i}", list(range(3, 67)), SamplingParams(max_tokens=64, **kw))
            r.output_token_ids = list(range(100, 132))
            reqs.append(r)
        sampler = Sampler(0, torch.device("cpu"), argmax)
        sampler(logits, reqs)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sampler(logits, reqs)
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = round(1e3 * statistics.median(times), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
