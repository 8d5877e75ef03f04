"""What constrained decoding costs: decode tok/s with and without a JSON schema, same run.

    python benchmarks/make_random_model.py --out benchmarks/models/qwen2.5-0.5b-tok32k --tokenizer-vocab 32000
    python benchmarks/structured_output_bench.py --model benchmarks/models/qwen2.5-0.5b-tok32k

Decode at batch sizes 1 and 8: 128 new tokens per request, tok/s = tokens generated after each
request's first / time from the first token to the last. The schema (an array of at least 200
records with bounded strings, numbers and enums) keeps the grammar busy with structure for every
token and cannot complete within 128 tokens, so every run has the same length. Also reports the
grammar compile time (cold and cached) and the mean time of one step's token masks.
Median of --repeats runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from anna import LLM, SamplingParams, StructuredOutputsParams
from anna.runtime import sampler as sampler_module

SCHEMA = {
    "type": "array", "minItems": 200,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                             "name": {"type": "string", "maxLength": 12},
                             "score": {"type": "number"},
                             "tags": {"type": "array", "maxItems": 3,
                                      "items": {"enum": ["alpha", "beta", "gamma", "delta"]}}}},
}


class MaskTimer:
    """Wraps the sampler's mask function to time it (only in this benchmark)."""

    def __init__(self) -> None:
        self.inner = sampler_module.apply_grammar_masks
        self.times: list[float] = []

    def __call__(self, *args) -> None:
        t0 = time.perf_counter()
        self.inner(*args)
        self.times.append(time.perf_counter() - t0)


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> float:
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            counts[out.request_id] = len(out.outputs[0].token_ids)
    start, end = min(first.values()), max(last.values())
    return sum(c - 1 for c in counts.values()) / (end - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/structured_output_bench.json"))
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    engine = llm.llm_engine
    timer = MaskTimer()
    sampler_module.apply_grammar_masks = timer
    spec = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    engine.structured.compile(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.structured.new_matcher(spec)
    warm = time.perf_counter() - t0
    results = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
               "tokenizer_vocab": engine.tokenizer.vocab_size, "model_vocab": engine.model_config.vocab_size,
               "compile_ms": {"cold_incl_token_trie": 1e3 * cold, "cached": 1e3 * warm}, "decode": {}}
    g = torch.Generator().manual_seed(0)
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        prompts = [torch.randint(3, 700, (32,), generator=g).tolist() for _ in range(bs)]
        free = SamplingParams(temperature=1.0, seed=1, max_tokens=args.new_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=args.new_tokens, ignore_eos=True,
                                     structured_outputs=spec)
        row = {}
        for name, params in (("free", free), ("json_schema", constrained)):
            decode_rate(llm, prompts, SamplingParams(max_tokens=8, ignore_eos=True,
                                                     structured_outputs=params.structured_outputs), "warm")
            timer.times.clear()
            rates = [decode_rate(llm, prompts, params, f"{name}{bs}-{r}") for r in range(args.repeats)]
            row[name] = {"decode_tok_s": statistics.median(rates)}
            if timer.times:
                row[name]["mask_ms_per_step"] = 1e3 * statistics.mean(timer.times)
        row["slowdown_pct"] = 100 * (1 - row["json_schema"]["decode_tok_s"] / row["free"]["decode_tok_s"])
        results["decode"][f"batch_{bs}"] = row
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
