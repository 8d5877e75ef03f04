"""Anthropic's Messages API over HTTP, with the official anthropic SDK: the same engine path as
chat, content blocks, tools, stop reasons, usage, the event stream, count_tokens, errors."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import SERVER_API_KEY, SERVER_MODEL

anthropic = pytest.importorskip("anthropic")
GREEDY = {"temperature": 0}  # (the current Messages API has no sampling fields; Anna still takes them)


@pytest.fixture(scope="module")
def claude(live_server):
    return anthropic.Anthropic(base_url=live_server, api_key=SERVER_API_KEY, max_retries=0)


def chat_text(server, messages, **kw) -> dict:
    return httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {SERVER_API_KEY}"},
                      json={"model": SERVER_MODEL, "messages": messages, **kw}, timeout=60).json()


def test_a_message_is_the_chat_completion_of_the_same_conversation(claude, live_server):
    msg = claude.messages.create(model=SERVER_MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "Hello"},
                                           {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
                                           {"role": "user", "content": [{"type": "text", "text": "Again"}]}])
    ref = chat_text(live_server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                                  {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}],
                    max_tokens=12, temperature=0)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg")
    assert "".join(b.text for b in msg.content if b.type == "text") == ref["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == ref["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == ref["usage"]["completion_tokens"]
    assert msg.stop_reason == ("max_tokens" if ref["choices"][0]["finish_reason"] == "length" else "end_turn")
    count = claude.messages.count_tokens(model=SERVER_MODEL, system="Be brief.",
                                         messages=[{"role": "user", "content": "Hello"},
                                                   {"role": "assistant", "content": "Hi."},
                                                   {"role": "user", "content": "Again"}])
    assert count.input_tokens == ref["usage"]["prompt_tokens"]


def test_the_stream_carries_the_same_text_and_stop_reason(claude):
    kw = dict(model=SERVER_MODEL, max_tokens=10, extra_body=GREEDY, messages=[{"role": "user", "content": "Stream"}])
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_forced_tool_use_comes_back_as_a_tool_use_block(claude):
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                               "required": ["city"], "additionalProperties": False}}]
    msg = claude.messages.create(model=SERVER_MODEL, max_tokens=200, tools=tools,
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert calls and calls[0].name == "get_weather" and isinstance(calls[0].input.get("city"), str)
    assert msg.stop_reason == "tool_use"
    # the result goes back as a tool_result block of the next user turn
    follow = claude.messages.create(model=SERVER_MODEL, max_tokens=5, tools=tools, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": calls[0].id, "name": "get_weather",
                                           "input": calls[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny"}]}])
    assert follow.type == "message"
    with claude.messages.stream(model=SERVER_MODEL, max_tokens=200, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "Weather in Rome?"}]) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert len(streamed) == 1 and streamed[0].name == "get_weather" and final.stop_reason == "tool_use"


def test_errors_are_anthropic_errors(claude, live_server):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=SERVER_MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in err.value.body["error"]["message"]
    r = httpx.post(live_server + "/v1/messages", headers={"x-api-key": SERVER_API_KEY},
                   content=json.dumps({"model": SERVER_MODEL, "messages": []}))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
