"""A flood of large /tokenize requests beside one chat request: how long the chat request waits,
and the server's peak RSS.

    python benchmarks/tokenize_flood.py                      # starts the demo model here
    python benchmarks/tokenize_flood.py --url http://127.0.0.1:8000

Eight concurrent /tokenize requests of --mib MiB of text each are sent, then (while they run) one
short chat completion; its latency is compared with the same request on the idle server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import cpu_model, rss_mib, start_server  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "ignore_eos": True}


async def flood(base: str, pid: int | None, n: int, mib: float) -> dict:
    text = ("the quick brown fox jumps over the lazy dog. " * int(mib * 1024 * 1024 / 45))
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        t0 = time.perf_counter()
        await client.post("/v1/chat/completions", json=CHAT)
        idle_chat = time.perf_counter() - t0
        peak = rss_mib(pid) if pid else None
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                if pid:
                    peak = max(peak or 0, rss_mib(pid) or 0)
                await asyncio.sleep(0.2)

        async def tokenize() -> tuple[int, float]:
            t = time.perf_counter()
            r = await client.post("/tokenize", json={"prompt": text})
            return r.status_code, time.perf_counter() - t

        watcher = asyncio.ensure_future(watch())
        floods = [asyncio.ensure_future(tokenize()) for _ in range(n)]
        await asyncio.sleep(0.5)  # the flood is under way
        t0 = time.perf_counter()
        r = await client.post("/v1/chat/completions", json=CHAT)
        busy_chat = time.perf_counter() - t0
        results = await asyncio.gather(*floods)
        done.set()
        await watcher
        after = rss_mib(pid) if pid else None
    return {"cpu": cpu_model(), "tokenize_requests": n, "mib_each": mib, "chat_idle_s": round(idle_chat, 3),
            "chat_during_flood_s": round(busy_chat, 3), "chat_status": r.status_code,
            "tokenize_statuses": sorted(s for s, _ in results), "tokenize_slowest_s": round(max(t for _, t in results), 2),
            "rss_peak_mib": peak and round(peak), "rss_after_mib": after and round(after)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--mib", type=float, default=4.0)
    args = ap.parse_args()
    proc, base = None, args.url
    if base is None:
        proc, base = start_server([])
    try:
        print(json.dumps(asyncio.run(flood(base, proc.pid if proc else None, args.requests, args.mib)), indent=1))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
