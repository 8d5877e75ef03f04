"""Talk to any OpenAI-compatible server over HTTP: streamed chat requests with timings, the
model's max_model_len, and prefix-cache counters from /metrics when the server exposes them."""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

import httpx

from anna.bench.stats import RequestRecord

PREFIX_COUNTERS = {  # server family -> (queries, hits) metric names, as Prometheus prints them
    "anna": ("anna:prefix_cache_queries_total", "anna:prefix_cache_hits_total"),
    "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
}


class BenchClient:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    async def close(self) -> None:
        await self.http.aclose()

    async def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"base_url": self.base_url, "model": self.model}
        try:
            r = await self.http.get("/v1/models")
            for m in r.json().get("data", []):
                if m.get("id") == self.model:
                    info["max_model_len"] = m.get("max_model_len")
        except (httpx.HTTPError, ValueError):
            pass
        return info

    async def count_tokens(self, text: str) -> int | None:
        """Token count from the server's /tokenize (Anna, vLLM); None when it has none."""
        try:
            r = await self.http.post("/tokenize", json={"model": self.model, "prompt": text})
            if r.status_code == 200:
                return int(r.json()["count"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        return None

    async def prefix_counters(self) -> dict[str, float] | None:
        """{"queries": q, "hits": h} summed over label sets, or None when /metrics has neither family."""
        try:
            r = await self.http.get("/metrics")
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        for queries, hits in PREFIX_COUNTERS.values():
            q, h = _metric_sum(r.text, queries), _metric_sum(r.text, hits)
            if q is not None and h is not None:
                return {"queries": q, "hits": h}
        return None

    async def chat(self, scenario: str, messages: list[dict], max_tokens: int, seed: int = 0,
                   extra: dict | None = None) -> RequestRecord:
        """One streamed chat completion at temperature 0, timed chunk by chunk."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "seed": seed, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
        rec = RequestRecord(scenario=scenario, start=time.perf_counter())
        rec.extra["output_text"] = ""
        text: list[str] = []
        thought: list[str] = []
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                    rec.end = time.perf_counter()
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        u = chunk["usage"]
                        rec.prompt_tokens = u.get("prompt_tokens", 0)
                        rec.completion_tokens = u.get("completion_tokens", 0)
                        rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for choice in chunk.get("choices", []):
                        delta = choice.get("delta") or {}
                        content = delta.get("content") or ""
                        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                        if content or reasoning:
                            rec.first_token = rec.first_token or now
                            rec.last_chunk = now
                        if content:
                            rec.first_content = rec.first_content or now
                            text.append(content)
                        thought.append(reasoning)
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.end = time.perf_counter()
        output = "".join(text)
        # the full output: reasoning and answer (two runs that think differently differ)
        full = json.dumps(["".join(thought), output], ensure_ascii=False)
        rec.output_hash = hashlib.sha256(full.encode()).hexdigest()[:16]
        rec.extra["output_text"] = output  # used for checks, dropped from results
        rec.ok = rec.error is None and rec.finish_reason is not None
        return rec


def _metric_sum(text: str, name: str) -> float | None:
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    values = [float(v) for v in pattern.findall(text)]
    return sum(values) if values else None
