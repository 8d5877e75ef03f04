"""Structured output and forced tool calls over HTTP, with the openai SDK against a live server."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from conftest import SERVER_API_KEY, SERVER_MODEL

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "units": {"enum": ["metric", "imperial"]}},
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "What's the weather like in Paris for the next three days?"}]


@pytest.fixture
def client(live_server):
    return openai.OpenAI(base_url=live_server + "/v1", api_key=SERVER_API_KEY, max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": SERVER_MODEL, "messages": MESSAGES, "temperature": 1.0,
                                             "max_tokens": 300, **kw})


def check_call(call) -> None:
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_response_format_json_schema_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    for seed in range(6):
        r = chat(client, response_format=fmt, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_response_format_json_schema_streams(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
    text = "".join(c.choices[0].delta.content or "" for c in chat(client, response_format=fmt, seed=3, stream=True)
                   if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object(client):
    r = chat(client, response_format={"type": "json_object"}, seed=1, max_tokens=120)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_guided_regex_and_choice_on_completions(client):
    r = client.completions.create(model=SERVER_MODEL, prompt="Call me at", max_tokens=40, temperature=1.0, seed=2,
                                  n=3, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) for c in r.choices)
    r = chat(client, extra_body={"guided_choice": ["sunny", "rainy"]}, seed=4)
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = chat(client, extra_body={"structured_outputs": {"json": SCHEMA}}, seed=6)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_tool_choice_required_calls_validate(client):
    names = set()
    for seed in range(6):
        r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1 and not choice.message.content
        check_call(choice.message.tool_calls[0])
        names.add(choice.message.tool_calls[0].function.name)
    assert names == {"get_weather", "add"}  # the model chooses among the tools


def test_tool_choice_required_parallel_calls_validate(client):
    counts = []
    for seed in range(4):
        r = chat(client, tools=TOOLS, tool_choice="required", seed=seed)
        choice = r.choices[0]
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
        if choice.finish_reason != "length":  # a weak model may keep calling until max_tokens
            assert choice.finish_reason == "tool_calls" and not choice.message.content
        counts.append(len(choice.message.tool_calls))
    assert max(counts) > 1


def test_named_tool_choice_forces_that_function(client):
    for seed in range(4):
        r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(calls) == 1 and calls[0].function.name == "add"
        check_call(calls[0])


def test_forced_tool_call_streams_as_tool_calls(client):
    chunks = list(chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       seed=5, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert len(deltas) > 3  # the arguments arrive as they are generated, not in one piece
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tool_choice_none_returns_no_calls(client):
    r = chat(client, tools=TOOLS, tool_choice="none", seed=0, max_tokens=30)
    assert not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "string", "enum": ["x" * 70000]}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tool_choice"),
])
def test_invalid_constraints_are_400(live_server, body, param):
    r = httpx.post(live_server + "/v1/chat/completions", headers={"Authorization": f"Bearer {SERVER_API_KEY}"},
                   json={"model": SERVER_MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert httpx.get(live_server + "/health").status_code == 200


def test_reasoning_server_constrains_the_answer_after_thinking(qwen2_dir, cache_dir):
    """--reasoning-parser think: the JSON schema applies after an optional <think> block. A random
    model, once in that block, rarely writes </think> by chance, so logit_bias steers the first
    token: towards "<" it thinks (until max_tokens), towards "{" it answers with valid JSON."""
    import asyncio

    from anna.core.config import ServeSettings
    from anna.server.app import create_app

    settings = ServeSettings(model=str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir),
                             max_model_len=512, num_gpu_blocks_override=64, reasoning_parser="think",
                             inference_warmup=False, log_level="error").resolve(env={})
    app = create_app(settings, load_in_background=False)
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}

    async def go():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=60) as client:
                ids = {}
                for ch in "<{":
                    r = await client.post("/tokenize", json={"prompt": ch, "add_special_tokens": False})
                    ids[ch] = r.json()["tokens"][0]
                out = {}
                for ch in "<{":
                    out[ch] = [(await client.post("/v1/chat/completions", json={
                        "messages": MESSAGES, "response_format": fmt, "max_tokens": 60, "temperature": 1.0,
                        "seed": seed, "logit_bias": {str(ids[ch]): 100}})).json()["choices"][0] for seed in range(3)]
                return out

    out = asyncio.run(go())
    for choice in out["<"]:
        assert choice["message"]["reasoning_content"] and not choice["message"]["content"]
    for choice in out["{"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_concurrent_mixed_requests_all_follow_their_constraints(live_server):
    """Constrained, forced-tool and free requests at once (so they share engine steps): each
    output follows its own constraint, and the free ones are unaffected."""
    import asyncio

    client = openai.AsyncOpenAI(base_url=live_server + "/v1", api_key=SERVER_API_KEY, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}

    async def one(i: int):
        kind = ("json", "tool", "free", "regex")[i % 4]
        extra = {"json": {"response_format": fmt},
                 "tool": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                 "free": {"max_tokens": 20, "extra_body": {"ignore_eos": True}},
                 "regex": {"extra_body": {"guided_regex": "[a-z]{3}-[0-9]{2}"}}}[kind]
        kw = {"model": SERVER_MODEL, "messages": MESSAGES, "temperature": 1.0, "seed": i, "max_tokens": 300, **extra}
        return kind, await client.chat.completions.create(**kw)

    async def run_all():
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await client.close()

    for kind, r in asyncio.run(run_all()):
        choice = r.choices[0]
        if kind == "json":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        elif kind == "tool":
            assert choice.finish_reason == "tool_calls"
            check_call(choice.message.tool_calls[0])
        elif kind == "regex":
            assert re.fullmatch("[a-z]{3}-[0-9]{2}", choice.message.content)
        else:
            assert choice.finish_reason == "length" and r.usage.completion_tokens == 20
