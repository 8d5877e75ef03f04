"""The HTTP server, exercised with the official openai SDK against a live server process."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from conftest import SERVER_API_KEY as API_KEY
from conftest import SERVER_MODEL as MODEL
from conftest import SERVER_MODEL_ALIAS


@pytest.fixture(scope="module")
def server(live_server):
    return live_server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metrics(server) -> dict[str, float]:
    text = httpx.get(server + "/metrics", headers=auth()).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^((?:anna|vllm):[a-z0-9_]+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if m:
            labels = [kv for kv in re.findall(r'[a-z_]+="[^"]*"', m.group(2) or "") if not kv.startswith("model_name")]
            key = m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")
            out[key] = float(m.group(3))
    return out


def wait_idle(server, timeout=20.0) -> dict[str, float]:
    """Poll the metrics until no request runs or waits (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["anna:num_requests_running"] == 0 and m["anna:num_requests_waiting"] == 0 \
                and m["anna:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_health_models_and_api_key_on_every_route(server):
    assert httpx.get(server + "/health").status_code == 200  # no auth needed
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/detokenize")]:
        r = httpx.request(method, server + path, json={})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.request(method, server + path, json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, path
    models = httpx.get(server + "/v1/models", headers=auth()).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 512


def test_chat_non_streaming_with_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
                                       temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_continuous_usage_stats_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far;
    without include_usage it has no effect."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=6, temperature=0, n=2,
              extra_body={"ignore_eos": True}, stream=True)
    chunks = list(client.chat.completions.create(
        **kw, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    prompt = chunks[-1].usage.prompt_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12  # both choices, at the end
    seen = {0: [], 1: []}
    for c in chunks[:-1]:
        assert c.usage.prompt_tokens == prompt
        assert c.usage.total_tokens == prompt + c.usage.completion_tokens
        seen[c.choices[0].index].append(c.usage.completion_tokens)
    for counts in seen.values():  # 0 with the role, then growing to the choice's 6 tokens
        assert counts[0] == 0 and counts[-1] == 6 and counts == sorted(counts)
    plain = list(client.chat.completions.create(**kw, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)

    prompts = ["a", "a longer prompt"]
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    lens = [len(httpx.post(client.base_url.join("/tokenize").__str__(), json={"prompt": p},
                           headers=auth()).json()["tokens"]) for p in prompts]
    last = {}
    for c in chunks[:-1]:
        i = c.choices[0].index
        assert c.usage.prompt_tokens == lens[i]
        assert c.usage.completion_tokens >= last.get(i, 0)
        last[i] = c.usage.completion_tokens
    assert last == {0: 5, 1: 5}
    assert chunks[-1].usage.prompt_tokens == sum(lens) and chunks[-1].usage.completion_tokens == 10


def test_completions_prompt_forms(client):
    a = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0)
    assert a.object == "text_completion" and len(a.choices) == 1
    b = client.completions.create(model=MODEL, prompt=["abc", "xyz"], max_tokens=4, temperature=0)
    assert [c.index for c in b.choices] == [0, 1]
    assert b.choices[0].text == a.choices[0].text
    ids = httpx.post(client.base_url.join("/tokenize").__str__(), json={"prompt": "abc"}, headers=auth()).json()
    c = client.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=4, temperature=0)
    assert c.choices[0].text == a.choices[0].text
    d = client.completions.create(model=MODEL, prompt=[ids["tokens"], ids["tokens"]], max_tokens=4, temperature=0)
    assert [x.text for x in d.choices] == [a.choices[0].text] * 2
    s = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, stream=True))
    assert "".join(x.choices[0].text for x in s) == a.choices[0].text


def test_n_samples_and_seed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Pick"}], max_tokens=8, temperature=1.0, seed=42,
              extra_body={"ignore_eos": True})
    r1 = client.chat.completions.create(**kw, n=2)
    r2 = client.chat.completions.create(**kw, n=2)
    assert [c.index for c in r1.choices] == [0, 1]
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]
    assert r1.usage.completion_tokens == 16
    streamed = list(client.chat.completions.create(**kw, n=2, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
             for i in range(2)]
    assert texts == [c.message.content for c in r1.choices]


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:7]
    assert len(stop) == 2
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[:base.find(stop)]


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    c = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 3


def test_multi_system_and_content_parts_are_accepted(client):
    msgs = [{"role": "system", "content": "A"}, {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                           {"type": "text", "text": "there"}]},
            {"role": "system", "content": "B"}, {"role": "developer", "content": "C"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "assistant", "content": None, "tool_calls": [  # arguments as an object, not a string
                {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {"a": 2}}}]},
            {"role": "tool", "tool_call_id": "c2", "content": "43"},
            {"role": "user", "content": None}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tools_round_trip_reaches_the_prompt(client, server):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris?"}],
                                           tools=tools, tool_choice=choice, max_tokens=3)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    msgs = [{"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=3)
    assert r.choices[0].message.role == "assistant"
    tok = httpx.post(server + "/tokenize", json={"messages": msgs}, headers=auth()).json()
    text = httpx.post(server + "/detokenize", json={"tokens": tok["tokens"]}, headers=auth()).json()["prompt"]
    assert "sunny, 21C" in text and "<|im_start|>tool" in text


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 600}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "min_tokens": 600}, "min_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content.str"),
])
def test_chat_errors_are_400_with_openai_shape(server, body, param):
    for stream in (False, True):
        r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "stream": stream, **body},
                       headers=auth())
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_prompt_too_long_message_gives_the_numbers(server):
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": list(range(3, 403)),
                                                     "max_tokens": 200}, headers=auth())
    assert r.status_code == 400
    assert "400 tokens" in r.json()["error"]["message"] and "max_model_len=512" in r.json()["error"]["message"]
    for body in ({"prompt": [5] * 600}, {"prompt": "hi " * 600}, {"prompt": [5] * 512, "max_tokens": 1}):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, **body}, headers=auth())
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and "max_model_len=512" in err["message"], err
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "hi " * 600}]}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_completion_fields_anna_cannot_honour_are_refused(server):
    for extra, param in (({"suffix": "end"}, "suffix"), ({"best_of": 3, "n": 2}, "best_of")):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", **extra}, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 2, "n": 2,
                                                     "suffix": "", "max_tokens": 2}, headers=auth())
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_unknown_routes_and_methods_answer_in_openai_error_shape(server):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        r = httpx.request(method, server + path, headers=auth())
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert "GET" in httpx.delete(server + "/v1/models", headers=auth()).headers["allow"]


def test_every_served_name_is_accepted_and_the_first_reported(server):
    """--served-model-name A B (as in vLLM): requests may name either; responses report A."""
    models = httpx.get(server + "/v1/models", headers=auth()).json()["data"]
    assert [m["id"] for m in models] == [MODEL, SERVER_MODEL_ALIAS]
    r = httpx.post(server + "/v1/completions", json={"model": SERVER_MODEL_ALIAS, "prompt": "x", "max_tokens": 2},
                   headers=auth())
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_models_retrieve_each_served_name(client, server):
    """client.models.retrieve: every served name (the model path too, slashes and all) and a 404 in
    OpenAI's error shape for any other."""
    for name in (MODEL, SERVER_MODEL_ALIAS):
        card = client.models.retrieve(name)
        assert card.id == name and card.object == "model"
    root = httpx.get(server + "/v1/models", headers=auth()).json()["data"][0]["root"]
    assert httpx.get(server + f"/v1/models/{MODEL}", headers=auth()).json()["root"] == root
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-5")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert httpx.get(server + f"/v1/models/{MODEL}").status_code == 401  # the key is needed here too


def test_invalid_json_unknown_model_and_bad_token_ids(server):
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={**auth(),
                                                                              "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server + "/v1/completions", json={"model": "gpt-5", "prompt": "x"}, headers=auth())
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert f"serves '{MODEL}', '{SERVER_MODEL_ALIAS}'" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 99999]}, headers=auth())
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": {"99999": 5}},
                   headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": []}, headers=auth())
    assert r.status_code == 400
    wait_idle(server)


def test_unknown_fields_are_ignored(server):
    r = httpx.post(server + "/v1/chat/completions", headers=auth(), json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "some_future_field": 1,
        "user": "u1", "max_completion_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_streaming_disconnect_frees_kv(server):
    before = metrics(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, headers=auth(), timeout=30) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
            if got >= 4:
                break
    after = wait_idle(server)
    assert after["anna:request_aborted_total"] == before["anna:request_aborted_total"] + 1


def test_non_streaming_disconnect_frees_kv(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "go", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers=auth(), timeout=0.1)  # gone long before 480 tokens
    after = wait_idle(server)
    assert after["anna:request_aborted_total"] == before["anna:request_aborted_total"] + 1


def test_32_concurrent_streaming_clients_complete(server):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"client {i}"}], max_tokens=8, stream=True,
            extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
        return usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(main()) == [8] * 32
    wait_idle(server)


def test_metrics_count_tokens_exactly(server, client):
    before = metrics(server)
    r = client.completions.create(model=MODEL, prompt="count me", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = wait_idle(server)
    assert after["anna:generation_tokens_total"] - before["anna:generation_tokens_total"] == 7
    assert after["anna:prompt_tokens_total"] - before["anna:prompt_tokens_total"] == r.usage.prompt_tokens
    key = 'anna:request_success_total{finished_reason="length"}'
    assert after[key] - before[key] == 1
    for name, moved in (("time_to_first_token_seconds", 1), ("inter_token_latency_seconds", 6),
                        ("e2e_request_latency_seconds", 1), ("request_queue_time_seconds", 1),
                        ("request_prefill_time_seconds", 1), ("request_decode_time_seconds", 1)):
        key = f"anna:{name}_count"
        assert after[key] - before[key] == moved, name
        assert after[f"anna:{name}_sum"] > before[f"anna:{name}_sum"]
    steps = sum(v for k, v in after.items() if k.startswith("anna:engine_steps_total"))
    assert steps - sum(v for k, v in before.items() if k.startswith("anna:engine_steps_total")) >= 7
    text = httpx.get(server + "/metrics", headers=auth()).text
    assert 'anna:cache_config_info{' in text and 'enable_prefix_caching="True"' in text


# The series vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana) queries,
# each filtered by model_name; and the ones autoscalers read
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
    "vllm:iteration_tokens_total_bucket", "vllm:inter_token_latency_seconds_bucket"]


def test_vllm_dashboard_series_exist_after_one_request(server, client):
    """Every series vLLM's dashboard queries exists, with the model_name label, and moved with
    one request; Anna's own names stay beside them (metrics_namespace both)."""
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(server)
    text = httpx.get(server + "/metrics", headers=auth()).text
    for series in VLLM_DASHBOARD_SERIES:
        assert re.search(rf'^{re.escape(series)}\{{[^}}]*model_name="{re.escape(MODEL)}"', text, re.M), series
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:request_generation_tokens_count"] - before["vllm:request_generation_tokens_count"] == 1
    assert after["vllm:request_generation_tokens_sum"] - before["vllm:request_generation_tokens_sum"] == 5
    assert after["vllm:request_max_num_generation_tokens_sum"] - before["vllm:request_max_num_generation_tokens_sum"] == 5
    assert after["vllm:iteration_tokens_total_sum"] - before["vllm:iteration_tokens_total_sum"] >= 5
    assert after["vllm:time_per_output_token_seconds_count"] - before["vllm:time_per_output_token_seconds_count"] == 4
    assert after["anna:generation_tokens_total"] == after["vllm:generation_tokens_total"]


def test_metrics_namespace_selects_the_prefixes(qwen2_dir, cache_dir):
    from anna.runtime.engine import LLMEngine
    from anna.server.metrics import EngineCollector, make_registry, render
    from conftest import engine_settings

    engine = LLMEngine(engine_settings(qwen2_dir, cache_dir), show_progress=False)
    for namespace, wanted in (("anna", {"anna"}), ("vllm", {"vllm"}), ("both", {"anna", "vllm"})):
        text = render(make_registry(EngineCollector(lambda: engine, "m", namespace))).decode()
        names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        assert {name.split(":")[0] for name in names} == wanted, namespace
        assert ("vllm:gpu_cache_usage_perc" in names) == ("vllm" in wanted)


def test_debug_profile_is_404_unless_profiling(server):
    r = httpx.get(server + "/debug/profile", headers=auth())
    assert r.status_code == 404 and "--profile-runtime" in r.json()["error"]["message"]


def test_random_parameter_combinations_never_500_and_leave_the_pool_free(server):
    """Seeded fuzzing of request bodies: every answer is a 200 or a 4xx, and the engine survives."""
    import random

    rng = random.Random(1234)
    choices = {
        "temperature": [0, 0.7, 1.5, 2, -1, "x", None], "top_p": [0.1, 1, 0, 1.5, None],
        "top_k": [-1, 0, 1, 50, 10**9, -5], "min_p": [0, 0.5, 1, 2], "presence_penalty": [-2, 0, 2, 3],
        "frequency_penalty": [-2, 1, 2.5], "repetition_penalty": [0.5, 1, 2, 0, -1],
        "seed": [0, -7, 2**63 - 1, 2**64, None, "s"], "stop": ["a", ["a", "b"], [], [""], None, 5],
        "n": [1, 2, 4, 5, 0], "max_tokens": [1, 5, 16, 0, 10**6, None], "min_tokens": [0, 2, 20, -1],
        "logprobs": [True, False], "top_logprobs": [0, 3, 20, 21], "logit_bias": [{"5": 10}, {"x": 1}, {"7": 200}],
        "ignore_eos": [True, False], "stream": [True, False], "stop_token_ids": [[1, 2], [-1], None],
    }
    statuses = []
    for i in range(60):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"fuzz {i}"}]}
        for key in rng.sample(sorted(choices), 6):
            value = rng.choice(choices[key])
            if value is not None:
                body[key] = value
        if body.get("max_tokens") in (None, 10**6) and body.get("min_tokens", 0) <= 20:
            body["max_tokens"] = 8  # keep the run short; the huge value is covered by other requests
        if body.get("stream"):
            with httpx.stream("POST", server + "/v1/chat/completions", json=body, headers=auth(), timeout=60) as r:
                text = "".join(r.iter_text())
                statuses.append(r.status_code)
                if r.status_code == 200:
                    assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
        else:
            r = httpx.post(server + "/v1/chat/completions", json=body, headers=auth(), timeout=60)
            statuses.append(r.status_code)
            if r.status_code == 400:
                assert r.json()["error"]["type"] == "invalid_request_error"
        assert statuses[-1] in (200, 400), (body, statuses[-1])
    assert 200 in statuses and 400 in statuses
    wait_idle(server)
    assert httpx.get(server + "/health").status_code == 200


def test_echo_with_logprobs_scores_the_prompt_like_transformers(server, hf_models):
    """What evaluation harnesses send to score a text: echo + logprobs (+ vLLM's prompt_logprobs)."""
    import json

    import torch

    ids = [(i * 29 + 5) % 700 + 3 for i in range(30)]
    ref = torch.log_softmax(hf_models["qwen2"][0](torch.tensor([ids])).logits[0].float(), dim=-1)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2,
            "prompt_logprobs": 1}
    r = httpx.post(server + "/v1/completions", json=body, headers=auth())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        assert abs(lp["token_logprobs"][pos] - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert len(lp["top_logprobs"][pos]) <= 2 and max(lp["top_logprobs"][pos].values()) == \
            pytest.approx(ref[pos - 1].max().item(), abs=1e-4)
        vllm_entry = choice["prompt_logprobs"][pos][str(ids[pos])]
        assert vllm_entry["logprob"] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, headers=auth()) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in lp}
    assert streamed == lp
    assert chunks[0]["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    r = httpx.post(server + "/v1/chat/completions", headers=auth(), json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    assert len(r.json()["choices"][0]["prompt_logprobs"]) == r.json()["usage"]["prompt_tokens"]


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(server):
    """The older loglikelihood request of evaluation harnesses (max_tokens 0, echo, logprobs): the
    prompt's text and logprobs, nothing generated; streaming it is refused with a 400."""
    ids = [(i * 29 + 5) % 700 + 3 for i in range(20)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    one = httpx.post(server + "/v1/completions", json=body, headers=auth()).json()
    zero = httpx.post(server + "/v1/completions", json={**body, "max_tokens": 0}, headers=auth()).json()
    choice, lp = zero["choices"][0], zero["choices"][0]["logprobs"]
    assert zero["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"] == one["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    prompt_text = httpx.post(server + "/detokenize", headers=auth(), json={"tokens": ids}).json()["prompt"]
    assert choice["text"] == prompt_text
    r = httpx.post(server + "/v1/completions", json={**body, "max_tokens": 0, "stream": True}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_allowed_token_ids_and_bad_words_over_http(server):
    r = httpx.post(server + "/v1/completions", headers=auth(), json={
        "model": MODEL, "prompt": "x", "max_tokens": 5, "ignore_eos": True, "allowed_token_ids": [321]})
    expected = httpx.post(server + "/detokenize", headers=auth(), json={"tokens": [321] * 5}).json()["prompt"]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    r = httpx.post(server + "/v1/completions", headers=auth(), json={
        "model": MODEL, "prompt": "x", "allowed_token_ids": [99999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    first = httpx.post(server + "/v1/completions", headers=auth(), json=body).json()["choices"][0]["logprobs"]["tokens"][0]
    r = httpx.post(server + "/v1/completions", headers=auth(), json={**body, "bad_words": [first]})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["tokens"][0] != first
    r = httpx.post(server + "/v1/completions", headers=auth(), json={**body, "bad_words": [""]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


def test_completions_default_to_16_tokens_chat_to_the_context(server):
    r = httpx.post(server + "/v1/completions", headers=auth(),
                   json={"model": MODEL, "prompt": "x", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default for completions, as in vLLM
    r = httpx.post(server + "/v1/completions", headers=auth(),
                   json={"model": MODEL, "prompt": [5] * 480, "ignore_eos": True, "max_tokens": None})
    assert r.json()["usage"]["completion_tokens"] == 512 - 480  # explicitly none: up to max_model_len


def test_truncate_prompt_tokens_over_http(server):
    r = httpx.post(server + "/v1/completions", headers=auth(), json={
        "model": MODEL, "prompt": [5] * 600, "max_tokens": 2, "truncate_prompt_tokens": 50, "echo": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50, r.text
    r = httpx.post(server + "/v1/chat/completions", headers=auth(), json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi " * 600}], "max_tokens": 2,
        "truncate_prompt_tokens": 40})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 40, r.text


def test_docs_page_loads_its_scripts_from_the_server(server):
    """/docs works offline: every script and stylesheet the page names is served by Anna."""
    import re

    page = httpx.get(server + "/docs", headers=auth())
    assert page.status_code == 200 and "swagger" in page.text.lower()
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assert assets and all(a.startswith("/") for a in assets), assets  # nothing from another host
    for asset in assets:
        r = httpx.get(server + asset, headers=auth())
        assert r.status_code == 200 and len(r.content) > 100, asset
