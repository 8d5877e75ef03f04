"""OpenAI's Responses API over HTTP with the openai SDK: the same engine path as chat."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import SERVER_API_KEY, SERVER_MODEL

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server + "/v1", api_key=SERVER_API_KEY, max_retries=0)


def test_a_response_is_the_chat_completion_of_the_same_input(client):
    r = client.responses.create(model=SERVER_MODEL, instructions="Be brief.", temperature=0, max_output_tokens=12,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}])
    ref = client.chat.completions.create(model=SERVER_MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert r.object == "response" and r.output_text == ref.choices[0].message.content
    assert r.usage.input_tokens == ref.usage.prompt_tokens and r.usage.output_tokens == ref.usage.completion_tokens
    assert r.status == ("incomplete" if ref.choices[0].finish_reason == "length" else "completed")


def test_the_stream_carries_the_same_text(client):
    kw = dict(model=SERVER_MODEL, input="Stream this", temperature=0, max_output_tokens=10)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == ("response.incomplete" if whole.status == "incomplete"
                                                           else "response.completed")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_calls_and_their_outputs(client):
    r = client.responses.create(model=SERVER_MODEL, input="Weather in Paris?", tools=[TOOL], max_output_tokens=200,
                                tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    follow = client.responses.create(model=SERVER_MODEL, tools=[TOOL], max_output_tokens=5, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.object == "response"
    with client.responses.stream(model=SERVER_MODEL, input="Weather in Rome?", tools=[TOOL], max_output_tokens=200,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        final = stream.get_final_response()
    assert [i.name for i in final.output if i.type == "function_call"] == ["get_weather"]


def test_text_format_json_schema_and_refusals(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model=SERVER_MODEL, input="Answer", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text)["ok"], bool)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=SERVER_MODEL, input="x", previous_response_id="resp_123")
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=SERVER_MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])


def test_previous_response_id_continues_the_stored_conversation(client):
    """A response continued by previous_response_id answers exactly what the whole conversation
    sent at once answers (greedy: the same text and the same prompt length); the store serves
    the response back, lists its input items, and forgets it on DELETE; store=false keeps none."""
    kw = dict(model=SERVER_MODEL, temperature=0, max_output_tokens=8)
    first = client.responses.create(**kw, instructions="Be brief.", input="Name a colour.")
    second = client.responses.create(**kw, instructions="Be brief.", input="And another?",
                                     previous_response_id=first.id)
    whole = client.responses.create(**kw, instructions="Be brief.", input=[
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And another?"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == whole.output_text
    streamed = list(client.responses.create(**kw, input="And a third?", previous_response_id=second.id, stream=True))
    third = streamed[-1].response
    assert third.usage.input_tokens > second.usage.input_tokens
    assert client.responses.retrieve(third.id).output_text == third.output_text  # the stream stored it too
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    items = client.responses.input_items.list(second.id).data
    assert [i.type for i in items] == ["message"] * 3  # newest first: this turn's input, then the first turn
    assert items[0].content[0].text == "And another?" and items[2].content[0].text == "Name a colour."
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**kw, input="x", previous_response_id=second.id)
    unstored = client.responses.create(**kw, input="Forget me", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_keeps_only_the_newest():
    from anna.server.response_store import ResponseStore, StoredResponse

    store = ResponseStore(2)
    for i in range(3):
        store.put(StoredResponse({"id": f"r{i}", "output": [{"type": "message"}]}, [{"role": "user", "content": str(i)}]))
    assert store.get("r0") is None and store.get("r1") and store.get("r2")
    assert store.get("r2").conversation == [{"role": "user", "content": "2"}, {"type": "message"}]
    empty = ResponseStore(0)
    empty.put(StoredResponse({"id": "x", "output": []}, []))
    assert empty.get("x") is None
