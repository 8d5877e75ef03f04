"""anna bench: the metric formulas on synthetic timings, the dataset generator, and the suite and
load mode end to end against a live Anna server."""

from __future__ import annotations

import json

import pytest

from anna.bench import datasets
from anna.bench.stats import (DEFAULT_TARGETS, RequestRecord, decode_tok_s, evaluate_targets, group_throughput,
                              load_summary, percentile, weighted_throughput)
from anna.cli.main import main
from conftest import SERVER_API_KEY, SERVER_MODEL


def rec(start, first, last, end, prompt=100, completion=11, cached=0, ok=True):
    return RequestRecord("x", ok=ok, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                         start=start, first_token=first, first_content=first, last_chunk=last, end=end,
                         finish_reason="stop")


def test_request_formulas():
    r = rec(10.0, 10.5, 12.5, 12.6)
    assert r.ttft == 0.5 and r.completion_time == pytest.approx(2.6)
    assert r.decode_tok_s == 5.0  # (11 - 1) / (12.5 - 10.5)
    assert decode_tok_s(1, 1.0, 2.0) is None and decode_tok_s(5, 1.0, 1.0) is None


def test_percentiles_interpolate_like_numpy():
    vals = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(vals, 50) == 3.0
    assert percentile(vals, 90) == pytest.approx(7.6)  # 4 + 0.6 * (10 - 4)
    assert percentile(vals, 10) == pytest.approx(1.4)
    assert percentile([], 50) is None


def test_group_and_load_aggregates_exact():
    records = [rec(0.0, 1.0, 3.0, 3.0, prompt=100, completion=21, cached=60),
               rec(1.0, 2.0, 6.0, 6.0, prompt=200, completion=41, cached=100),
               rec(2.0, 9.0, 9.0, 10.0, ok=False, completion=0)]
    assert group_throughput(records[:2]) == pytest.approx(62 / 6.0)
    s = load_summary(records, wall=10.0)
    assert s["success_rate"] == pytest.approx(2 / 3)
    assert s["cache_hit_rate"] == pytest.approx(160 / 300)
    assert s["output_tps"] == pytest.approx(6.2) and s["input_tps"] == pytest.approx(14.0)
    assert s["cache_tps"] == pytest.approx(16.0)
    assert s["weighted_throughput"] == pytest.approx(6.2 * 16.796 + 14.0 * 2.799 + 16.0 * 0.56)
    assert s["ttft_p50_s"] == pytest.approx(1.0)  # ttfts 1.0 and 1.0
    assert s["request_output_tps_p50"] == pytest.approx(10.0)  # 20/2 and 40/4
    verdict = evaluate_targets(s, DEFAULT_TARGETS)
    assert verdict == {"output_tps_p10": False, "ttft_p90": True, "cache_hit_rate": True, "success_rate": False,
                       "weighted_throughput": False}
    assert weighted_throughput(1, 1, 1) == pytest.approx(16.796 + 2.799 + 0.56)


def test_dataset_is_deterministic_and_turns_share_prefixes():
    a = datasets.generate(seed=7, conversations=6, turns=4, system_words=80, max_tokens_per_request=2000)
    b = datasets.generate(seed=7, conversations=6, turns=4, system_words=80, max_tokens_per_request=2000)
    assert a == b
    assert a != datasets.generate(seed=8, conversations=6, turns=4, system_words=80, max_tokens_per_request=2000)
    by_conv: dict[int, list[dict]] = {}
    for row in a:
        by_conv.setdefault(row["conversation"], []).append(row)
    assert any(len(rows) > 1 for rows in by_conv.values())
    for rows in by_conv.values():
        for prev, cur in zip(rows, rows[1:]):
            assert cur["messages"][:len(prev["messages"])] == prev["messages"]  # each turn extends the last
    systems = {row["messages"][0]["content"] for row in a}
    assert len(systems) == 3  # long system prompts shared across conversations
    assert any("tools" in row for row in a)
    assert any(m.get("tool_calls") for row in a for m in row["messages"])
    assert any(m["role"] == "tool" for row in a for m in row["messages"])
    capped = datasets.generate(seed=7, conversations=6, turns=20, system_words=80, max_tokens_per_request=600)
    assert all(datasets.estimate_tokens(r["messages"]) + r["max_tokens"] <= 600 for r in capped)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "key"
    path.write_text(SERVER_API_KEY + "\n")
    return path


def test_suite_end_to_end_against_anna(live_server, key_file, tmp_path, capsys):
    out = tmp_path / "suite.json"
    assert main(["bench", "serve", "--base-url", live_server, "--model", SERVER_MODEL, "--label", "tiny",
                 "--api-key-file", str(key_file), "--max-tokens", "8", "--out", str(out)]) == 0
    text = out.read_text()
    assert SERVER_API_KEY not in text and SERVER_API_KEY not in capsys.readouterr().out
    result = json.loads(text)
    names = [s["name"] for s in result["scenarios"]]
    assert names == ["explanations_sequential", "coding_smoke", "explanations_concurrency_2",
                     "explanations_concurrency_4", "passcode_8k_cold", "passcode_8k_repeat", "passcode_32k_cold",
                     "passcode_32k_repeat"]  # the warm-up is excluded
    assert result["server"]["max_model_len"] == 512
    for sc in result["scenarios"]:
        assert all(r["ok"] for r in sc["records"]), sc
        # the cache-counter deltas match the server's own per-request accounting
        assert sc["prefix_cache_delta"]["queries"] == sum(r["prompt_tokens"] for r in sc["records"])
        assert sc["prefix_cache_delta"]["hits"] == sum(r["cached_tokens"] for r in sc["records"])
        if sc["name"].startswith("passcode"):
            assert sc["long_context"]["clipped"] and sc["records"][0]["prompt_tokens"] <= 512 - 32
            assert sc["records"][0]["prompt_tokens"] > 200  # still a long context, as far as the server allows
    repeat = next(s for s in result["scenarios"] if s["name"] == "passcode_8k_repeat")
    assert repeat["prefix_cache_delta"]["hits"] > 0  # the repeat finds the first send's blocks
    assert result["scenarios"][3]["group_throughput_tok_s"] > 0
    assert "random-weight" in result["note"]  # a random model fails the passcode checks


def test_load_mode_and_compare(live_server, key_file, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    assert main(["bench", "dataset", "--out", str(data), "--conversations", "3", "--turns", "3",
                 "--system-words", "40", "--max-tokens-per-request", "200", "--answer-tokens", "6"]) == 0
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    out = tmp_path / "load.json"
    assert main(["bench", "serve", "--base-url", live_server, "--model", SERVER_MODEL, "--label", "load",
                 "--api-key-file", str(key_file), "--dataset", str(data), "--concurrency", "2",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["requests"] == len(rows) and s["success_rate"] == 1.0
    assert s["cache_hit_rate"] > 0  # turns and conversations share prefixes
    assert s["prefix_cache_delta"]["hits"] == sum(r["cached_tokens"] for r in result["records"])
    assert set(result["pass"]) == {"output_tps_p10", "ttft_p90", "cache_hit_rate", "success_rate",
                                   "weighted_throughput"}
    capsys.readouterr()
    plots = tmp_path / "plots"
    assert main(["bench", "compare", str(out), str(out), "--plots", str(plots)]) == 0
    table = capsys.readouterr().out
    assert "| metric | load | load |" in table and "weighted_throughput" in table
    assert sorted(p.name for p in plots.glob("*.png")) == ["decode_speed.png", "throughput.png", "ttft.png"]


def test_output_hash_covers_reasoning_as_well_as_content():
    """Two streams with the same answer and different reasoning have different hashes; the
    answer alone is what checks read."""
    import asyncio

    import httpx

    from anna.bench.client import BenchClient

    def stream(reasoning: str) -> bytes:
        chunks = [{"choices": [{"delta": {"reasoning_content": reasoning}}]},
                  {"choices": [{"delta": {"content": "42"}, "finish_reason": "stop"}]}]
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"

    async def run(reasoning: str):
        client = BenchClient("http://test", "m")
        client.http = httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(
            lambda request: httpx.Response(200, content=stream(reasoning))))
        try:
            return await client.chat("s", [{"role": "user", "content": "q"}], 8)
        finally:
            await client.close()

    first, second, again = (asyncio.run(run(r)) for r in ("think A", "think B", "think A"))
    assert first.extra["output_text"] == second.extra["output_text"] == "42"
    assert first.output_hash != second.output_hash and first.output_hash == again.output_hash
