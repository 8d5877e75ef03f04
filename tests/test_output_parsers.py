"""Tool-call and reasoning parsers on model-output strings, whole and split at every position."""

from __future__ import annotations

import json

import pytest

from anna.server.reasoning import ThinkReasoningParser
from anna.server.tool_parsers import HermesToolParser, parse_tool_calls

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
