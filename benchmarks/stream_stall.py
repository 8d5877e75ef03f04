"""How long one streaming request stalls while another client sends a very long prompt, against
any OpenAI-compatible server: the longest gap between two chunks of the stream.

    anna serve --port 8000 &
    python benchmarks/stream_stall.py --base-url http://127.0.0.1:8000 --model anna-demo

A server that tokenizes on its event loop pauses every stream for as long as the long prompt
takes to tokenize (about 1 s per MB of text); the long prompt is then refused for exceeding
max_model_len, which does not matter here.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx


async def longest_gap(http: httpx.AsyncClient, model: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    gaps, last = [0.0], None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return max(gaps)


async def long_prompt(http: httpx.AsyncClient, model: str, megabytes: float, delay_s: float) -> int:
    await asyncio.sleep(delay_s)  # once the stream is flowing
    text = "hello world, this is a test. " * int(megabytes * 1e6 / 29)
    return (await http.post("/v1/completions", json={"model": model, "prompt": text})).status_code


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="anna-demo")
    ap.add_argument("--megabytes", type=float, default=1.0, help="size of the long prompt")
    ap.add_argument("--max-tokens", type=int, default=400, help="length of the stream (long enough to overlap)")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    async with httpx.AsyncClient(base_url=args.base_url, timeout=120) as http:
        for _ in range(args.runs):
            gap, status = await asyncio.gather(longest_gap(http, args.model, args.max_tokens),
                                               long_prompt(http, args.model, args.megabytes, 0.3))
            print(f"longest gap between chunks: {gap * 1000:.0f} ms (long prompt answered {status})")


if __name__ == "__main__":
    asyncio.run(main())
