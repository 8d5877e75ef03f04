"""Decode speed and capacity of each KV cache dtype, in one run (pairs alternate within a context).

    python benchmarks/make_random_model.py --out benchmarks/models/qwen2.5-0.5b
    python benchmarks/kv_cache_bench.py --model benchmarks/models/qwen2.5-0.5b \\
        --contexts 512 8192 32768 --kv-cache-dtypes auto bfloat16 int8 turboquant4

For each context: a prompt of that many random tokens (fewer where the model's positions end) is prefilled, then ``--new-tokens`` are
decoded with ignore_eos (batch 1); tok/s = (tokens - 1) / (time of the last - time of the first).
``--streams N --stream-context C``: N requests of C tokens decoding together (their prompts share
all but their last 16 tokens, so that the run's prefill stays short; their KV reads are those of
N sequences of C tokens, the shared blocks read once per sequence). Capacity: the tokens the pool
holds in ``--budget-gib`` of KV memory (the start-up memory plan), and the bytes per token.
Greedy agreement: the decoded tokens of each dtype against the first dtype's, same prompt.
``--repeat-prompt N``: a prompt of N tokens sent twice, its second time-to-first-token served by
paged prefix blocks (the exact prompt cache off) and by the exact prompt cache (4 entries), for
each dtype, then the same prompt with its last 32 tokens changed (a shared system prompt, a new
question): the measurement behind the exact prompt cache's automatic default.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from anna import LLM, SamplingParams


def engine(args, dtype: str, max_len: int, streams: int = 1) -> LLM:
    blocks = streams * (-(-max_len // 16)) + 8
    return LLM(args.model, dtype=args.dtype, kv_cache_dtype=dtype, max_model_len=max_len, num_gpu_blocks_override=blocks,
               max_num_seqs=max(streams, 1), quantization=args.quantization, cache_dir=args.cache_dir,
               enable_prefix_caching=streams > 1)


def decode_run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(seconds to the first tokens, decode tok/s over all streams, the tokens) of one batch."""
    eng = llm.llm_engine
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}-{t0}", p, params)
    stamps, tokens = [], {}  # (time, tokens that step added, requests with a token so far)
    while eng.has_unfinished_requests():
        outs = eng.step()
        added = 0
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            added += len(ids) - len(tokens.get(o.request_id, ()))
            tokens[o.request_id] = ids
        if added:
            stamps.append((time.perf_counter(), added, len(tokens)))
    first = next(t for t, _, started in stamps if started == len(prompts))  # every stream has its first token
    after = [n for t, n, _ in stamps if t > first]
    rate = sum(after) / (stamps[-1][0] - first) if after else float("nan")
    return first - t0, rate, [tokens[k] for k in sorted(tokens)]


def repeat_prompt(args, prompt: list[int]) -> dict:
    """TTFT of a prompt's first and second sending, served the second time by paged prefix blocks
    or by the exact prompt cache, per dtype; the decoded tokens compared with the first sending's."""
    out = {"tokens": len(prompt)}
    for dtype in args.kv_cache_dtypes:
        for mode, size in (("prefix_blocks", 0), ("exact_prompt_cache", 4)):
            llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=dtype, max_model_len=len(prompt) + args.new_tokens + 16,
                      max_num_seqs=1, quantization=args.quantization, cache_dir=args.cache_dir, enable_prefix_caching=True,
                      prompt_cache_size=size, prompt_cache_max_tokens=max(len(prompt), 2048))
            cold, _, first = decode_run(llm, [prompt], args.new_tokens)
            warm, _, again = decode_run(llm, [prompt], args.new_tokens)
            shared, _, _ = decode_run(llm, [prompt[:-32] + [t + 1 for t in prompt[-32:]]], args.new_tokens)
            out.setdefault(dtype, {})[mode] = {"ttft_cold_s": round(cold, 3), "ttft_repeat_s": round(warm, 3),
                                              "ttft_same_prefix_new_tail_s": round(shared, 3),
                                              "same_tokens": first == again}
            print("repeat", dtype, mode, out[dtype][mode], flush=True)
            del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 8192, 32768])
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "bfloat16", "int8", "turboquant4"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, default=0)
    ap.add_argument("--stream-context", type=int, default=4096)
    ap.add_argument("--repeat-prompt", type=int, default=0)
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--cache-dir", default="~/.cache/anna")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_cache_bench.json"))
    args = ap.parse_args()
    rng = random.Random(0)
    with open("/proc/cpuinfo") as fh:
        cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")),
                   platform.processor() or platform.machine())
    result = {"cpu": cpu, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "model": args.model, "dtype": args.dtype,
              "quantization": args.quantization, "capacity": {}, "batch1": [], "streams": None, "repeat_prompt": None}
    for dtype in args.kv_cache_dtypes:
        # one sequence: a hybrid model's per-sequence recurrent state (and its prefix snapshots) would
        # otherwise take the budget's share of max_num_seqs slots, which is not what a KV row costs
        llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=dtype, kv_cache_memory=args.budget_gib,
                  max_model_len=512, max_num_seqs=1, cache_dir=args.cache_dir, quantization=args.quantization)
        plan = llm.llm_engine.cache_plan
        result["capacity"][dtype] = {"bytes_per_token": plan.bytes_per_token, "tokens_in_budget": plan.num_tokens}
        print(dtype, result["capacity"][dtype], flush=True)
        del llm
    limit = json.loads((Path(args.model) / "config.json").read_text())["max_position_embeddings"]
    for context in args.contexts:
        context = min(context, limit - args.new_tokens - 16)  # the prompt and its new tokens fit the model
        prompt = [rng.randrange(3, 700) for _ in range(context)]
        row = {"context": context}
        ref = None
        for dtype in args.kv_cache_dtypes:
            llm = engine(args, dtype, context + args.new_tokens + 16)
            ttft, rate, tokens = decode_run(llm, [prompt], args.new_tokens)
            same = next((i for i, (a, b) in enumerate(zip(tokens[0], ref)) if a != b), len(ref)) if ref else None
            ref = ref or tokens[0]
            row[dtype] = {"prefill_s": round(ttft, 2), "decode_tok_s": round(rate, 2), "same_first_tokens": same}
            print(context, dtype, row[dtype], flush=True)
            del llm
        result["batch1"].append(row)
    if args.streams:
        shared = [rng.randrange(3, 700) for _ in range(args.stream_context - 16)]
        prompts = [shared + [rng.randrange(3, 700) for _ in range(16)] for _ in range(args.streams)]
        row = {"streams": args.streams, "context": args.stream_context}
        for dtype in args.kv_cache_dtypes:
            llm = engine(args, dtype, args.stream_context + args.new_tokens + 16, args.streams)
            _, rate, _ = decode_run(llm, prompts, args.new_tokens)
            row[dtype] = {"decode_tok_s": round(rate, 2)}
            print("streams", dtype, row[dtype], flush=True)
            del llm
        result["streams"] = row
    if args.repeat_prompt:
        result["repeat_prompt"] = repeat_prompt(args, [rng.randrange(3, 700) for _ in range(args.repeat_prompt)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
