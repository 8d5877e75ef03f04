"""Continuous batching: aggregate output tok/s at several concurrencies, and time to first token
with a long prompt prefix cached versus not.

    python benchmarks/throughput_bench.py --model benchmarks/models/qwen2.5-0.5b

Aggregate tok/s = all output tokens / wall time from submitting the group to its last token
(prefill included). Requests: distinct random 64-token prompts, 128 new tokens, ignore_eos.
Prefix TTFT: a --prefix-tokens prompt sent twice with different 16-token tails; the second finds
the prefix in the prefix cache (the cache counters are printed, not inferred from speed).
--profile-runtime: where the decode phase's steps spend their time at each concurrency, region by
region (diagnosis: it runs the model op by op, so its tok/s are not the engine's).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from anna import LLM, SamplingParams


def run_group(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first = None
    first_step_outputs = 0  # the requests that got their first token in the first step with output
    tokens = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if outs and first is None:
            first, first_step_outputs = time.perf_counter(), len(outs)
            if engine.profiler is not None:
                engine.profiler.reset()  # the decode phase alone
        for out in outs:
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    end = time.perf_counter()
    wall = end - t0
    # decode phase: the tokens after that first step over the time after it, which is what
    # llama-batched-bench reports as S_TG
    result = {"requests": len(prompts), "output_tokens": tokens, "wall_s": round(wall, 3),
              "aggregate_tok_s": round(tokens / wall, 2), "ttft_first_s": round(first - t0, 3),
              "decode_phase_tok_s": round((tokens - first_step_outputs) / (end - first), 2) if end > first else None}
    if engine.profiler is not None:
        result["decode_phase_profile"] = engine.profiler.report()
        print(tag, engine.profiler.table(), flush=True)
    return result


def ttft(engine, prompt: list[int], tag: str) -> float:
    t0 = time.perf_counter()
    engine.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--profile-runtime", action="store_true",
                    help="also print where the decode phase's time goes (runs the model op by op)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput_bench.json"))
    args = ap.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(levels), max_model_len=4096,
              quantization=args.quantization, profile_runtime=args.profile_runtime)
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 700, (n,), generator=g).tolist()

    run_group(engine, [rand(args.prompt_tokens)], 8, "warm")
    results: dict = {"machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                     "model": args.model, "dtype": args.dtype, "quantization": args.quantization, "concurrency": {}}
    for c in levels:
        results["concurrency"][c] = run_group(engine, [rand(args.prompt_tokens) for _ in range(c)],
                                              args.new_tokens, f"c{c}")
        print(c, results["concurrency"][c], flush=True)
    single = results["concurrency"].get(1, {}).get("aggregate_tok_s")
    if single:
        results["speedup_vs_single"] = {c: round(r["aggregate_tok_s"] / single, 2)
                                        for c, r in results["concurrency"].items()}

    prefix = rand(args.prefix_tokens)
    hits0 = engine.kv.prefix_cache_hits
    cold = ttft(engine, prefix + rand(16), "prefix-cold")
    hits1 = engine.kv.prefix_cache_hits
    warm = ttft(engine, prefix + rand(16), "prefix-warm")
    hits2 = engine.kv.prefix_cache_hits
    results["prefix_ttft"] = {"prefix_tokens": args.prefix_tokens, "uncached_s": round(cold, 3),
                              "cached_s": round(warm, 4), "speedup": round(cold / warm, 1),
                              "cached_tokens_first": hits1 - hits0, "cached_tokens_second": hits2 - hits1}
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
