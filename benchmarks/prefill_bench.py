"""Prefill speed of Anna against the rate of the model's own matmuls on torch's fastest path,
measured in the same run: how much of the machine's matmul throughput a prefill turns into tokens.

    python benchmarks/prefill_bench.py --model benchmarks/models/qwen2.5-0.5b --prompt-tokens 2048

Prefill: one --prompt-tokens prompt of distinct random ids (time to its first token, prefix caching
off, the prompt in one step, or in steps of --chunk tokens: the step's token budget,
max_num_batched_tokens, which is what splits a lone prompt; the scheduler's chunk size,
long_prefill_token_threshold, applies only while other requests run beside it). Matmul ceiling: every linear layer of the loaded model except the
lm_head (a prefill samples one position) as a torch matmul of --prompt-tokens rows on a row-major
copy of its weight, timed in bf16 (bf16 activations: oneDNN's AVX512-BF16/AMX kernels where the
CPU has them) and in fp32, each into a fresh output and into one written before (a fresh block of
over 32 MB costs a page fault per 4 KB page), the fastest per shape; the ceiling's tokens/s = prompt tokens
/ the sum over layers. The two alternate --repeats times (this VM's speed drifts); each figure is
the median, and ``fraction`` = prefill tok/s / ceiling tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from anna import LLM
from anna.model.linear import Linear, QuantLinear
from anna.platforms.cpu.isa import detect_isa
from throughput_bench import ttft  # (benchmarks/ is on the path when this runs as a script)


def linear_shapes(llm: LLM) -> Counter:
    """(out_features, in_features) -> how many layers have it, over the model's linears but the lm_head."""
    model = llm.llm_engine.runner.model
    shapes: Counter = Counter()
    for name, module in model.named_modules():
        if isinstance(module, (Linear, QuantLinear)) and not name.endswith("lm_head"):
            shapes[(module.out_features, module.in_features)] += 1
    return shapes


def best_matmul_s(n: int, k: int, m: int) -> tuple[float, str]:
    """The fastest of torch's bf16 and fp32 matmuls of [m, k] x [k, n] here, into a fresh output
    or a reused one (median of 5 after 2 warm-ups)."""
    best = (float("inf"), "")
    for dtype in (torch.bfloat16, torch.float32):
        w = (torch.randn(n, k) / k ** 0.5).to(dtype)
        x = torch.randn(m, k).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        for name, matmul in (("", lambda: F.linear(x, w)), (" reused output", lambda: torch.mm(x, w.t(), out=out))):
            times = []
            for i in range(7):
                t0 = time.perf_counter()
                matmul()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            best = min(best, (statistics.median(times), str(dtype).removeprefix("torch.") + name))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--cpu-isa", default="auto", help="CPU kernel level (a lower one than the CPU's forces its path)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="Prompt tokens per step (max_num_batched_tokens): 0 = the whole prompt in one step")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_bench.json"))
    args = ap.parse_args()

    m = args.prompt_tokens
    llm = LLM(args.model, dtype=args.dtype, device="cpu", enable_prefix_caching=False, quantization=args.quantization,
              max_model_len=max(4096, m + 16), max_num_batched_tokens=args.chunk or max(2048, m), cpu_isa=args.cpu_isa,
              inference_warmup=False)
    chunk = llm.llm_engine.settings.max_num_batched_tokens
    shapes = linear_shapes(llm)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.runner.model.config.vocab_size

    def prompt(i: int) -> list[int]:
        return torch.randint(3, vocab, (m,), generator=gen).tolist()

    ttft(llm.llm_engine, prompt(0), "warm")
    prefills, ceilings, paths = [], [], {}
    for r in range(args.repeats):
        prefills.append(ttft(llm.llm_engine, prompt(r + 1), f"r{r}"))
        total = 0.0
        for (n, k), count in shapes.items():
            seconds, path = best_matmul_s(n, k, m)
            paths[f"{n}x{k}"] = path
            total += count * seconds
        ceilings.append(total)
    prefill_tok_s = m / statistics.median(prefills)
    ceiling_tok_s = m / statistics.median(ceilings)
    isa = detect_isa(force=args.cpu_isa)
    results = {"cpu": isa.model_name, "cpu_isa": isa.level, "threads": torch.get_num_threads(),
               "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
               "quantization": args.quantization, "prompt_tokens": m, "chunk": chunk,
               "prefill_tok_s": round(prefill_tok_s, 1), "prefill_s_runs": [round(s, 3) for s in prefills],
               "matmul_ceiling_tok_s": round(ceiling_tok_s, 1), "matmul_ceiling_s_runs": [round(s, 3) for s in ceilings],
               "matmul_ceiling_path": paths, "fraction": round(prefill_tok_s / ceiling_tok_s, 3)}
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
