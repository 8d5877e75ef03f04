"""Time of one sampler call over a batch of logits, for the sampling mixes a server sees.

    python benchmarks/sampler_bench.py --vocab 151936 --rows 16

Mixes: all greedy (one argmax), all sampled (temperature, top_p, top_k), and sampled with
penalties and bad words (the per-row path). Median of --repeats calls after a warm-up call.
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
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab)
    out = {"vocab": args.vocab, "rows": args.rows, "threads": 2}
    for name, kw in MIXES.items():
        reqs = []
        for i in range(args.rows):
            r = Request(f"r{i}", list(range(3, 67)), SamplingParams(max_tokens=64, **kw))
            r.output_token_ids = list(range(100, 132))
            reqs.append(r)
        sampler = Sampler(0, torch.device("cpu"))
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
