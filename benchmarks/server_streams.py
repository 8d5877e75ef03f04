"""Aggregate output tok/s of N concurrent requests against any OpenAI-compatible server (Anna,
llama.cpp's llama-server, vLLM), so that servers are compared with one client and one workload.

    anna serve --model benchmarks/models/qwen2.5-0.5b --quantization int4 --max-num-seqs 16 --port 8000
    python benchmarks/server_streams.py --base-url http://127.0.0.1:8000 --model qwen2.5-0.5b

Each of --streams requests is a /v1/completions call whose prompt is --prompt-tokens distinct random
token ids (seeded), asking for --max-tokens tokens with ignore_eos, all sent at once. Aggregate
tok/s = completion tokens (from each response's usage) / wall time from sending the group to the
last response; prefill is included, as in benchmarks/quant_bench.py. One warm-up group runs first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = await http.post("/v1/completions", json=body)
    resp.raise_for_status()
    usage = resp.json()["usage"]
    if usage["completion_tokens"] != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {usage['completion_tokens']} (ignore_eos unsupported?)")
    return usage["completion_tokens"]


async def run_group(http: httpx.AsyncClient, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one_request(http, model, p, max_tokens) for p in prompts))
    wall = time.perf_counter() - t0
    return {"output_tokens": sum(tokens), "wall_s": round(wall, 3), "aggregate_tok_s": round(sum(tokens) / wall, 2)}


async def wait_ready(http: httpx.AsyncClient, timeout_s: float = 600.0) -> None:
    """Until /health answers 200 (Anna, llama-server and vLLM answer 503 there while loading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await http.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


async def main_async(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(3, args.vocab_limit) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]

    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), timeout=3600) as http:
        await wait_ready(http)
        await run_group(http, args.model, prompts()[:2], 8)  # warm-up
        runs = [await run_group(http, args.model, prompts(), args.max_tokens) for _ in range(args.repeats)]
    best = max(runs, key=lambda r: r["aggregate_tok_s"])
    return {"base_url": args.base_url, "streams": args.streams, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "runs": runs, "best_aggregate_tok_s": best["aggregate_tok_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True, help="the model name the server expects")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vocab-limit", type=int, default=700, help="prompt token ids are drawn from [3, this)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main_async(args)), indent=1))


if __name__ == "__main__":
    main()
