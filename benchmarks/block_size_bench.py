"""Decode speed against KV block size: engines that differ only in --block-size hold the same
requests, and their decode steps alternate one by one, so that a drift of the host's speed falls
on all of them alike.

    python benchmarks/block_size_bench.py --model benchmarks/models/qwen2.5-0.5b --quantization int4 \\
        --context 1024 --streams 16 --block-sizes 16 128

Each engine prefills --streams distinct random prompts of --context tokens (prefix caching off),
then every engine runs --steps decode steps in turn. Prints each engine's median and best step
and the median ratio of the first block size's step time to each other's, step pair by step pair.
What a larger block costs is not measured here: prefixes are shared in whole blocks, so a reused
prompt recomputes up to block_size - 1 tokens of it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from anna import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each request")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 700) for _ in range(args.context)] for _ in range(args.streams)]
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    engines = []
    for bs in args.block_sizes:
        engine = LLM(args.model, dtype=args.dtype, quantization=args.quantization, block_size=bs,
                     max_model_len=args.context + args.steps + 64, max_num_seqs=args.streams,
                     enable_prefix_caching=False).llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        started, t0 = 0, time.perf_counter()
        while started < args.streams:  # until every request has its first token
            started += sum(1 for out in engine.step() if len(out.outputs[0].token_ids) == 1)
        print(f"block size {bs}: prefill {time.perf_counter() - t0:.1f} s", flush=True)
        engines.append(engine)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(args.steps):
        for k, engine in enumerate(engines):
            t0 = time.perf_counter()
            engine.step()
            times[k].append(time.perf_counter() - t0)
    base = times[0]
    result = {"model": args.model, "quantization": args.quantization, "context": args.context,
              "streams": args.streams, "steps": args.steps, "block_sizes": {}}
    for bs, t in zip(args.block_sizes, times):
        ratios = [a / b for a, b in zip(base, t)]
        result["block_sizes"][bs] = {"step_ms_median": round(statistics.median(t) * 1e3, 1),
                                     "step_ms_best": round(min(t) * 1e3, 1),
                                     f"speedup_vs_{args.block_sizes[0]}_median": round(statistics.median(ratios), 3),
                                     "speedup_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)[::2]]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
