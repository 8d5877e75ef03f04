"""Prefill and single-stream decode speed of Anna, next to transformers in the same run.

    python benchmarks/make_random_model.py --out benchmarks/models/qwen2.5-0.5b
    python benchmarks/decode_bench.py --model benchmarks/models/qwen2.5-0.5b

Prefill: one 512-token prompt (time to the first token). Decode: batch 1, 128 new tokens with
ignore_eos, tok/s = 127 / (time of last token - time of first token). Median of --repeats runs
after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from anna import LLM, SamplingParams


def anna_run(llm: LLM, prompt: list[int], new_tokens: int, rid: str) -> tuple[float, float]:
    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        for _ in engine.step():
            stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return ttft, decode


def hf_run(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """transformers' generate: time to first token = generate(1 token); decode from generate(N) - that."""
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    with torch.inference_mode():
        ttft = timed(1)
        total = timed(new_tokens)
    return ttft, (new_tokens - 1) / max(1e-9, total - ttft)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-transformers", action="store_true", help="Skip the transformers baseline.")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_bench.json"))
    ap.add_argument("--label", default="anna")
    ap.add_argument("--decode-executor", default="auto", choices=["auto", "eager", "graph"])
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--cpu-isa", default="auto", help="CPU kernel level (a lower one than the CPU's forces its path)")
    args = ap.parse_args()

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 700, (args.prompt_tokens,), generator=g).tolist()
    results = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
               "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "quantization": args.quantization,
               "cpu_isa": args.cpu_isa}

    llm = LLM(args.model, dtype=args.dtype, device=args.device, enable_prefix_caching=False,
              decode_executor=args.decode_executor, quantization=args.quantization, max_model_len=args.max_model_len,
              cpu_isa=args.cpu_isa)
    results["decode_executor"] = llm.llm_engine.decode_executor
    anna_run(llm, prompt, 8, "warm")
    runs = [anna_run(llm, prompt, args.new_tokens, f"r{i}") for i in range(args.repeats)]
    results["anna"] = {"prefill_tok_s": args.prompt_tokens / statistics.median(r[0] for r in runs),
                       "decode_tok_s": statistics.median(r[1] for r in runs)}
    del llm
    if not args.no_transformers:  # (its weights as they are: no quantized baseline)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        hf_run(model, prompt, 8)
        runs = [hf_run(model, prompt, args.new_tokens) for _ in range(args.repeats)]
        results["transformers"] = {"prefill_tok_s": args.prompt_tokens / statistics.median(r[0] for r in runs),
                                   "decode_tok_s": statistics.median(r[1] for r in runs)}
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
