"""The fixed scenario suite (``--suite standard``) and the dataset replay (load mode)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Awaitable, Callable

from anna.bench.client import BenchClient, counter_deltas
from anna.bench.stats import RequestRecord, group_throughput, load_summary

WARMUP = "What is 17 + 25? Answer with the number only."
EXPLANATIONS = [
    "请解释什么是机器学习，以及它与传统编程有什么不同。",
    "请用通俗易懂的语言解释量子计算的基本原理。",
    "请解释区块链技术的工作原理及其主要应用场景。",
]
CODING = "Write a Python function that returns the n-th Fibonacci number."
LONG_CONTEXT_TARGETS = (8000, 32000)
ANSWER_TOKENS = 32
TEMPLATE_MARGIN = 64  # tokens the chat template may add around the prompt text
WORDS = ("amber basalt cedar delta ember fjord garnet harbor indigo juniper kestrel lagoon meadow nectar "
         "obsidian prairie quartz river sierra tundra umber valley willow xenon yarrow zephyr").split()


def archive_text(seed: int, lines: int, passcode: str) -> str:
    """A seeded pseudo-random archive with the passcode in its middle line."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        if i == lines // 2:
            out.append(f"Record {i:05d}: IMPORTANT - the passcode is {passcode}. Remember it.")
        else:
            out.append(f"Record {i:05d}: " + " ".join(rng.choice(WORDS) for _ in range(10)) + ".")
    return "\n".join(out)


def passcode_question(archive: str) -> str:
    return (f"Below is an archive of records.\n\n{archive}\n\n"
            "What is the passcode mentioned in the archive? Answer with the passcode only.")


async def build_long_prompt(client: BenchClient, seed: int, target_tokens: int, max_model_len: int | None
                            ) -> tuple[str, str, dict]:
    """A passcode prompt of about target_tokens, clipped to fit the server's max_model_len."""
    limit = target_tokens
    clipped = False
    if max_model_len:
        room = max_model_len - ANSWER_TOKENS - TEMPLATE_MARGIN
        if room < limit:
            limit, clipped = max(room, 64), True
    passcode = f"{random.Random(seed).randrange(10**5, 10**6)}"
    lines = max(1, limit // 30)
    text = passcode_question(archive_text(seed, lines, passcode))
    for _ in range(4):  # refine the line count with the server's own tokenizer when it has one
        count = await client.count_tokens(text)
        if count is None or abs(count - limit) <= limit * 0.03 and count <= limit:
            break
        lines = max(1, int(lines * limit / count * 0.99))
        text = passcode_question(archive_text(seed, lines, passcode))
    meta = {"target_tokens": target_tokens, "limit_tokens": limit, "clipped": clipped, "lines": lines}
    return text, passcode, meta


async def run_standard_suite(client: BenchClient, max_tokens: int, seed: int,
                             progress: Callable[[str], None]) -> list[dict]:
    info = await client.server_info()
    scenarios: list[dict] = []

    async def scenario(name: str, work: Awaitable, extra: dict | None = None) -> list[RequestRecord]:
        before = await client.counters()
        t0 = time.perf_counter()
        records = list(await work)
        wall = time.perf_counter() - t0
        delta = counter_deltas(before, await client.counters())
        scenarios.append({"name": name, "records": records, "wall_s": wall, "prefix_cache_delta": delta["prefix"],
                          "spec_decode_delta": delta["spec_decode"],
                          "group_throughput_tok_s": group_throughput(records), **(extra or {})})
        progress(name)
        return records

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    async def sequential(name: str, prompts: list[str], answer_tokens: int = max_tokens) -> list[RequestRecord]:
        out = []
        for p in prompts:
            out.append(await client.chat(name, user(p), answer_tokens, seed))
        return out

    warm = await client.chat("warmup", user(WARMUP), 16, seed)
    progress("warmup")
    for r in await scenario("explanations_sequential", sequential("explanations_sequential", EXPLANATIONS)):
        r.check = "pass" if r.ok and r.extra["output_text"].strip() else "fail"
    for r in await scenario("coding_smoke", sequential("coding_smoke", [CODING])):
        r.check = "pass" if r.ok and r.extra["output_text"].strip() else "fail"
    for c in (2, 4):
        prompts = [EXPLANATIONS[i % len(EXPLANATIONS)] for i in range(c)]
        name = f"explanations_concurrency_{c}"
        recs = await scenario(name, asyncio.gather(*(client.chat(name, user(p), max_tokens, seed) for p in prompts)),
                              {"concurrency": c})
        for r in recs:
            r.check = "pass" if r.ok and r.extra["output_text"].strip() else "fail"
    for target in LONG_CONTEXT_TARGETS:
        text, passcode, meta = await build_long_prompt(client, seed + target, target, info.get("max_model_len"))
        for label in ("cold", "repeat"):
            name = f"passcode_{target // 1000}k_{label}"
            recs = await scenario(name, sequential(name, [text], ANSWER_TOKENS), {"long_context": meta})
            for r in recs:
                r.check = "pass" if passcode in r.extra["output_text"] and r.finish_reason == "stop" else "fail"
    del warm  # the warm-up request is excluded from every statistic
    return scenarios


def read_dataset(path: Path) -> list[dict]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if line.strip():
            row = json.loads(line)
            if "messages" not in row:
                raise ValueError(f"{path}:{i + 1}: each row needs 'messages'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


async def run_load(client: BenchClient, rows: list[dict], concurrency: int, num_requests: int | None,
                   duration: float | None, seed: int, progress: Callable[[str], None]) -> dict:
    """Replay dataset rows in order with ``concurrency`` workers, for K requests or S seconds."""
    records: list[RequestRecord] = []
    next_index = 0
    total = num_requests if num_requests is not None else (None if duration else len(rows))
    t0 = time.perf_counter()
    before = await client.counters()

    async def worker() -> None:
        nonlocal next_index
        while True:
            if total is not None and next_index >= total:
                return
            if duration is not None and time.perf_counter() - t0 >= duration:
                return
            row = rows[next_index % len(rows)]
            next_index += 1
            extra = {k: row[k] for k in ("tools",) if k in row}
            rec = await client.chat("load", row["messages"], int(row.get("max_tokens", 128)), seed, extra)
            records.append(rec)
            progress("load")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    delta = counter_deltas(before, await client.counters())
    summary = load_summary(records, wall)
    if delta["prefix"] is not None:
        summary["prefix_cache_delta"] = delta["prefix"]
    if delta["spec_decode"] is not None:
        summary["spec_decode_delta"] = delta["spec_decode"]
    return {"records": records, "summary": summary, "concurrency": concurrency}
