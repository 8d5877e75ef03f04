"""Greedy tokens of Anna and of llama.cpp's llama-server on the same GGUF file and the same prompts
(token ids, so that both see the same input whatever their tokenizers do).

    python benchmarks/export_gguf.py --model benchmarks/models/qwen2.5-0.5b --out qwen-f16.gguf
    llama-quantize --pure qwen-f16.gguf qwen-q4_0-pure.gguf Q4_0
    python benchmarks/gguf_agreement.py --gguf qwen-q4_0-pure.gguf --llama-server /path/llama.cpp/build/bin/llama-server

Both multiply Q4_0 weights by activations rounded to 8 bits per 32 values, in a different order
of fp32 sums (and llama.cpp keeps its KV cache in f16), so where two logits come within that
rounding of each other the greedy choice may differ and the continuations part: the report gives,
per prompt, how many leading tokens agree, and at the first generated position (the same input for
both) how far apart the two engines' log-probabilities of llama.cpp's top 5 tokens are, beside the
margin between its first and second choice. --anna-dequant adds the same gap between Anna's own
two int4 paths (activations rounded to int8, or kept in fp32 with int4_matmul=dequant): what
that rounding alone moves.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from pathlib import Path

import httpx

from anna import LLM, SamplingParams


def llama_tokens(binary: str, gguf: Path, prompts: list[list[int]], new_tokens: int,
                 port: int) -> list[tuple[list[int], dict[int, float]]]:
    """Each prompt's greedy tokens and its first position's top-5 log-probabilities."""
    server = subprocess.Popen([binary, "-m", str(gguf), "-t", "2", "--port", str(port), "-np", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("llama-server did not start")
                time.sleep(0.5)
            out = []
            for p in prompts:
                body = {"prompt": p, "n_predict": new_tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                        "cache_prompt": False, "return_tokens": True, "n_probs": 5}
                resp = http.post("/completion", json=body)
                resp.raise_for_status()
                data = resp.json()
                # (llama-server leaves the probabilities out of some answers whose text ends inside a
                # UTF-8 character: those prompts get no gap)
                probs = data.get("completion_probabilities") or [{"top_logprobs": []}]
                first = probs[0]["top_logprobs"]
                out.append((data["tokens"], {t["id"]: t["logprob"] for t in first}))
            return out
    finally:
        server.terminate()
        server.wait()


def anna_tokens(gguf: Path, prompts: list[list[int]], new_tokens: int, cache_dir: str,
                int4_matmul: str = "auto") -> list[tuple[list[int], dict[int, float]]]:
    """The same, with the first position's top-20 log-probabilities."""
    llm = LLM(model=str(gguf), cache_dir=cache_dir, log_level="warning", int4_matmul=int4_matmul)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=20)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), {i: lp.logprob for i, lp in o.outputs[0].logprobs[0].items()})
            for o in outs]


def gap(mine: dict[int, float], top: dict[int, float]) -> float | None:
    """The largest difference of log-probabilities over ``top``'s tokens that ``mine`` lists too."""
    shared = [abs(mine[i] - lp) for i, lp in top.items() if i in mine]
    return round(max(shared), 4) if shared else None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama-server", required=True, help="Path of llama.cpp's llama-server binary.")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--vocab-limit", type=int, default=700, help="Prompt ids are drawn below this.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8089)
    ap.add_argument("--cache-dir", default="~/.cache/anna")
    ap.add_argument("--anna-dequant", action="store_true", help="Also compare Anna's two int4 paths.")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab_limit) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    ours = anna_tokens(args.gguf, prompts, args.new_tokens, args.cache_dir)
    theirs = llama_tokens(args.llama_server, args.gguf, prompts, args.new_tokens, args.port)
    agree = [common_prefix(a[0], b[0]) for a, b in zip(ours, theirs)]
    gaps = [gap(mine, top) for (_, mine), (_, top) in zip(ours, theirs)]
    margins = [round(best[0] - best[1], 4) if len(best) > 1 else None
               for best in (sorted(top.values(), reverse=True) for _, top in theirs)]
    report = {"gguf": str(args.gguf), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "identical": sum(a == args.new_tokens for a in agree),
              "leading_tokens_agreeing": agree, "first_position_max_logprob_gap": gaps,
              "first_position_llama_top2_margin": margins,
              "anna": [t for t, _ in ours], "llama_cpp": [t for t, _ in theirs]}
    if args.anna_dequant:
        fp32_x = anna_tokens(args.gguf, prompts, 1, args.cache_dir, int4_matmul="dequant")
        report["first_position_gap_anna_int8_x_vs_fp32_x"] = [gap(a, b) for (_, a), (_, b) in zip(ours, fp32_x)]
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in report.items() if k not in ("anna", "llama_cpp")}))


if __name__ == "__main__":
    main()
