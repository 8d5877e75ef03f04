"""Engine decode speed with the weights and KV cache on huge pages (the default) against small
pages, alternated in one process so that the VM's drift affects both alike.

    python benchmarks/huge_pages_bench.py --model benchmarks/models/qwen2.5-0.5b --quantization int4

Per round and setting: batch-1 decode tok/s (64-token prompt, 128 new tokens, ignore_eos) and the
decode phase of 16 concurrent requests (tokens after the first step over the time after it).
Prints each setting's median and the median of the per-round ratios (huge / small).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from anna import LLM
from decode_bench import anna_run
from throughput_bench import run_group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 700, (n,), generator=g).tolist()

    llms = {huge: LLM(args.model, dtype="bfloat16", quantization=args.quantization, max_num_seqs=args.streams,
                      max_model_len=4096, enable_prefix_caching=False, cpu_huge_pages=huge)
            for huge in (True, False)}
    for llm in llms.values():
        anna_run(llm, rand(64), 8, "warm")
    single: dict[bool, list[float]] = {True: [], False: []}
    streams: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for huge, llm in llms.items():
            single[huge].append(anna_run(llm, rand(64), 128, f"single{r}")[1])
            group = run_group(llm.llm_engine, [rand(64) for _ in range(args.streams)], 128, f"group{r}")
            streams[huge].append(group["decode_phase_tok_s"])
    result = {}
    for name, runs in (("decode_tok_s_batch1", single), (f"decode_phase_tok_s_{args.streams}_streams", streams)):
        result[name] = {"huge_pages": round(statistics.median(runs[True]), 2),
                        "small_pages": round(statistics.median(runs[False]), 2),
                        "ratio_median": round(statistics.median(h / s for h, s in zip(runs[True], runs[False])), 3)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
