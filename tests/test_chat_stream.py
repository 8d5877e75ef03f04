"""The server's chat output shaping, fed with engine outputs whose text contains tool calls and
reasoning (a random-weight model never writes them): streamed deltas and the whole message."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from anna.core.outputs import CompletionOutput, RequestOutput
from anna.server.common import finish_reason
from anna.server.serving_chat import ChatRun, chat_stream
from anna.server.tool_parsers import HermesToolParser

TEXT = ('<think>need weather</think>\n\nChecking.<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>')


def outputs(text: str, step: int, finish: str = "stop"):
    """Cumulative outputs as the engine yields them, `step` characters at a time."""
    for end in range(step, len(text) + step, step):
        end = min(end, len(text))
        done = end == len(text)
        yield RequestOutput("r", None, [1], [CompletionOutput(0, text[:end], list(range(end)),
                                                              finish if done else None)], done)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def run_for(gen=None, reasoning: str = "think", tools=WEATHER, parser=HermesToolParser) -> ChatRun:
    """A started chat request as start_chat returns it, over these engine outputs."""
    return ChatRun(gen, "x", [1, 2, 3, 4, 5], tools, parser if tools else None, reasoning, False, "none",
                   SimpleNamespace(n=1), None)


def run_stream(step: int, text: str = TEXT, finish: str = "stop") -> list[dict]:
    async def gen():
        for out in outputs(text, step, finish):
            yield out

    async def collect():
        return [chunk async for chunk in chat_stream(run_for(gen()), {"id": "x", "created": 0, "model": "m"},
                                                     True, False)]

    chunks = asyncio.run(collect())
    assert chunks[-1] == "data: [DONE]\n\n"
    return [json.loads(c[6:]) for c in chunks[:-1]]


def test_streamed_tool_calls_and_reasoning_at_every_chunk_size():
    for step in (1, 2, 3, 7, 16, len(TEXT)):
        events = run_stream(step)
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
        assert "".join(d.get("content", "") for d in deltas) == "Checking."
        calls = [c for d in deltas for c in d.get("tool_calls", [])]  # the first has id, type and name
        assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        assert calls[0]["function"]["name"] == "get_weather"
        assert all(c["index"] == 0 and "id" not in c for c in calls[1:])
        arguments = "".join(c["function"]["arguments"] for c in calls)
        assert json.loads(arguments) == {"city": "Paris"}
        finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
        assert finals == ["tool_calls"]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(TEXT)


def test_whole_message_parsing_and_finish_reason():
    parser = run_for().choice_parser()
    reasoning, content, deltas = parser.feed(TEXT, final=True)
    assert (reasoning, content, deltas) == ("need weather", "Checking.", [])  # deltas are for streams
    assert [c.name for c in parser.calls] == ["get_weather"]
    out = CompletionOutput(0, TEXT, [1], "stop")
    assert finish_reason(out, parser) == "tool_calls"
    plain = run_for(reasoning="none", tools=None).choice_parser()  # no tools in the request: text stays text
    assert plain.feed(TEXT, final=True) == ("", TEXT, [])
    assert finish_reason(out, plain) == "stop"
    assert finish_reason(CompletionOutput(0, "x", [1], "length"), parser) == "length"


def test_a_call_cut_off_by_max_tokens_streams_as_far_as_written_and_no_markup():
    """max_tokens ends the output inside a call: the stream has sent its name and arguments so far,
    no content beyond the text before it, and finish_reason length, at every chunk size."""
    cut = TEXT[:TEXT.index('"Paris"') + 4]
    for step in (1, 3, 16, len(cut)):
        deltas = [e["choices"][0] for e in run_stream(step, cut, "length") if e["choices"]]
        assert "".join(d["delta"].get("content", "") for d in deltas) == "Checking."
        calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Par'
        assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["length"]
    parser = run_for().choice_parser()
    _, content, _ = parser.feed(cut, final=True)
    assert content == "Checking." and parser.calls[0].arguments == '{"city": "Par'
    assert finish_reason(CompletionOutput(0, cut, [1], "length"), parser) == "length"
