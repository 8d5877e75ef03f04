"""Decode speed and load time for each weight format: none (bf16), int8, int4, and checkpoints
that are already quantized (a GGUF file, a GPTQ directory: LABEL=PATH, served as their own format).

    python benchmarks/quant_bench.py --model benchmarks/models/qwen2.5-0.5b
    python benchmarks/quant_bench.py --model benchmarks/models/qwen2.5-0.5b --formats int4,gguf-q4_0=model-q4_0.gguf

Per format: decode tok/s at batch 1 (64-token prompt, 128 new tokens, ignore_eos; median of
--repeats runs), aggregate
output tok/s of 16 concurrent requests (prefill included) and of their decode phase (after the
first step's tokens: llama-batched-bench's S_TG), and load time. For int4 (and a checkpoint
served as int4) the load is timed twice: cold (the int4 layout cache emptied first) and warm
(read from the cache).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from anna import LLM
from decode_bench import anna_run
from throughput_bench import run_group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--formats", default="none,int8,int4")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/quant_bench.json"))
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 700, (n,), generator=g).tolist()

    results: dict = {"machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                     "model": args.model, "formats": {}}
    cache_dir = Path(tempfile.mkdtemp(prefix="anna-int4-cache-"))
    try:
        for fmt in args.formats.split(","):
            fmt, _, path = fmt.partition("=")  # LABEL=PATH: that checkpoint in its own format
            model, quantization = (path, "auto") if path else (args.model, fmt)
            row: dict = {"model": model}
            llm = None
            for which in ("cold", "warm"):
                del llm
                t0 = time.perf_counter()
                llm = LLM(model, dtype="bfloat16", quantization=quantization, max_num_seqs=args.streams,
                          max_model_len=4096, int4_cache_dir=str(cache_dir), enable_prefix_caching=False,
                          calibrate=False)  # (a once-per-host cost, not the load's: built-in routing for all)
                row[f"load_{which}_s"] = round(time.perf_counter() - t0, 2)
                if llm.llm_engine.settings.quantization != "int4":
                    break  # nothing cached: a second load times the same work
            engine = llm.llm_engine
            row["served_as"] = engine.settings.quantization
            anna_run(llm, rand(64), 8, f"{fmt}-warm")
            decodes = [anna_run(llm, rand(64), 128, f"{fmt}-single{i}")[1] for i in range(args.repeats)]
            row["decode_tok_s_batch1"] = round(statistics.median(decodes), 2)
            group = run_group(engine, [rand(64) for _ in range(args.streams)], 128, f"{fmt}-group")
            row[f"aggregate_tok_s_{args.streams}_streams"] = group["aggregate_tok_s"]
            row[f"decode_phase_tok_s_{args.streams}_streams"] = group["decode_phase_tok_s"]
            results["formats"][fmt] = row
            print(fmt, row, flush=True)
            del llm
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
