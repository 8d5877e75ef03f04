"""Talk to any OpenAI-compatible server over HTTP: streamed chat requests with timings, the
model's max_model_len, and prefix-cache and speculative-decoding counters from /metrics when the
server exposes them."""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

import httpx

from anna.bench.stats import RequestRecord

# What a scenario reads from /metrics before and after: counter -> its name per server family, as
# Prometheus prints them. prefix: queries, hits (tokens); spec_decode: speculative decoding's drafts,
# draft tokens, accepted tokens.
COUNTERS = {
    "prefix": {"queries": "prefix_cache_queries_total", "hits": "prefix_cache_hits_total"},
    "spec_decode": {"drafts": "spec_decode_num_drafts_total", "draft_tokens": "spec_decode_num_draft_tokens_total",
                    "accepted_tokens": "spec_decode_num_accepted_tokens_total"},
}
SERVER_FAMILIES = ("anna", "vllm")  # metric name prefixes


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

    async def counters(self) -> dict[str, dict[str, float] | None]:
        """{"prefix": {"queries": q, "hits": h}, "spec_decode": {...}} summed over label sets; a
        group is None when /metrics has none of it (or there is no /metrics)."""
        out: dict[str, dict[str, float] | None] = {group: None for group in COUNTERS}
        try:
            r = await self.http.get("/metrics")
        except httpx.HTTPError:
            return out
        if r.status_code != 200:
            return out
        for group, names in COUNTERS.items():
            for family in SERVER_FAMILIES:
                values = {key: _metric_sum(r.text, f"{family}:{name}") for key, name in names.items()}
                if all(v is not None for v in values.values()):
                    out[group] = values
                    break
        return out

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


def counter_deltas(before: dict[str, dict | None], after: dict[str, dict | None]) -> dict[str, dict | None]:
    """Per counter group, after - before (None where either side has none); speculative decoding's
    also carries its acceptance rate over the interval."""
    out: dict[str, dict | None] = {}
    for group in COUNTERS:
        b, a = before.get(group), after.get(group)
        out[group] = None if a is None or b is None else {key: a[key] - b[key] for key in a}
    spec = out.get("spec_decode")
    if spec is not None:
        spec["acceptance_rate"] = spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None
    return out
