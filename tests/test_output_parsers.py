"""Tool-call and reasoning parsers on model-output strings, whole and split at every position."""

from __future__ import annotations

import json

import pytest

from anna.server.reasoning import ThinkReasoningParser
from anna.server.tool_parsers import HermesToolParser, ToolCallStreamer, parse_tool_calls

OUTPUTS = [
    # (model output, expected content, expected calls [(name, arguments dict)])
    ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}'
     '</tool_call>', "", [("a", {}), ("b", {"x": [1, 2]})]),  # whitespace between calls is not content
    ("No tools here, just < and <tool but no call.", "No tools here, just < and <tool but no call.", []),
    ('<tool_call>{"name": "f", "arguments": {"q": "<tool_call> inside"}}</tool_call>', "",
     [("f", {"q": "<tool_call> inside"})]),
    ('<tool_call>{broken json}</tool_call>after', '<tool_call>{broken json}</tool_call>after', []),
    ('text <tool_call>{"name": "late", "arguments": {"k": "中文"}}', "text ", [("late", {"k": "中文"})]),
]


def run_split(text: str, cuts: list[int]) -> tuple[str, list]:
    parser = HermesToolParser()
    content, calls = "", []
    prev = 0
    for cut in cuts + [len(text)]:
        c, k = parser.feed(text[prev:cut])
        content += c
        calls += k
        prev = cut
    c, k = parser.finish()
    return content + c, calls + k


@pytest.mark.parametrize("text, content, expected", OUTPUTS)
def test_tool_calls_whole(text, content, expected):
    got_content, calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("text, content, expected", OUTPUTS)
def test_tool_calls_split_at_every_position(text, content, expected):
    for cut in range(len(text) + 1):
        got_content, calls = run_split(text, [cut])
        assert got_content == content, cut
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected, cut
    # and one character at a time: nothing that belongs to a call ever leaks as content
    parser = HermesToolParser()
    streamed = "".join(parser.feed(ch)[0] for ch in text) + parser.finish()[0]
    assert streamed == content


def stream_calls(pieces: list[str]) -> tuple[str, dict[int, dict], int]:
    """Feed pieces to a streamer as the server does; rebuild the calls the way an OpenAI client
    does (by index: id, name, then arguments appended). Returns content, calls, argument deltas."""
    streamer = ToolCallStreamer(HermesToolParser())
    content, calls, arg_deltas = "", {}, 0
    for k, piece in enumerate(pieces):
        c, deltas = streamer.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"].get("arguments", "")
            arg_deltas += bool(d["function"].get("arguments"))
    return content, calls, arg_deltas


@pytest.mark.parametrize("text, content, expected", OUTPUTS)
def test_streamed_tool_calls_add_up_to_the_calls(text, content, expected):
    for pieces in [[text], list(text) + [""]] + [[text[:cut], text[cut:]] for cut in range(len(text) + 1)]:
        got_content, calls, _ = stream_calls(pieces)
        assert got_content == content
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == expected
        assert all(c["id"].startswith("call_") for c in calls.values())


def test_streamed_arguments_arrive_piece_by_piece():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    content, calls, arg_deltas = stream_calls(list(text) + [""])
    assert content == "" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == '{"city": "Paris", "days": 3}'
    assert arg_deltas > 10
    # the name is out before the arguments are complete
    streamer = ToolCallStreamer(HermesToolParser())
    _, deltas = streamer.feed(text[:text.index("Paris")])
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}


REASONING = [
    ("<think>plan it</think>\n\nThe answer.", "plan it", "The answer."),
    ("  <think>a<b</think>c", "a<b", "c"),
    ("Just an answer <think> not at start", "", "Just an answer <think> not at start"),
    ("<think>unfinished thought", "unfinished thought", ""),
    ("<thin", "", "<thin"),
]


@pytest.mark.parametrize("text, reasoning, content", REASONING)
def test_reasoning_split_at_every_position(text, reasoning, content):
    for cut in range(len(text) + 1):
        p = ThinkReasoningParser()
        r1, c1 = p.feed(text[:cut])
        r2, c2 = p.feed(text[cut:])
        r3, c3 = p.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == (reasoning, content), cut
