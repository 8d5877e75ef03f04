"""Tool-call and reasoning parsers on model-output strings, whole and split at every position."""

from __future__ import annotations

import json

import pytest

from anna.server.reasoning import ThinkReasoningParser
from anna.server.tool_parsers import (ForcedJsonToolParser, HermesToolParser, Llama3JsonToolParser,
                                      MistralToolParser, ToolCallStreamer, parse_tool_calls)

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


def stream_calls(pieces: list[str], parser=HermesToolParser) -> tuple[str, dict[int, dict], int]:
    """Feed pieces to a streamer as the server does; rebuild the calls the way an OpenAI client
    does (by index: id, name, then arguments appended). Returns content, calls, argument deltas."""
    streamer = ToolCallStreamer(parser())
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


OTHER_FORMATS = [
    # (parser, model output, expected content, expected calls)
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, 2]}}',
     "", [("a", {}), ("b", {"x": [1, 2]})]),
    (Llama3JsonToolParser, '  {"answer": 42}', '  {"answer": 42}', []),  # JSON that is not a call is content
    (Llama3JsonToolParser, 'It is {"name": "x", "parameters": {}}', 'It is {"name": "x", "parameters": {}}', []),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
     "", [("get_weather", {"city": "Paris"})]),
    (MistralToolParser, 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]note[ARGS]{"text": "hi"}',
     "Sure.", [("get_weather", {"city": "Paris"}), ("note", {"text": "hi"})]),
    (MistralToolParser, "No calls [TOOL but brackets [", "No calls [TOOL but brackets [", []),
    (ForcedJsonToolParser, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "note", '
                           '"parameters": {"text": "a \\"quoted\\" }"}}]', "",
     [("get_weather", {"city": "Paris"}), ("note", {"text": 'a "quoted" }'})]),
]


@pytest.mark.parametrize("parser, text, content, expected", OTHER_FORMATS)
def test_other_formats_whole_split_and_streamed(parser, text, content, expected):
    """Llama 3 JSON, Mistral and the forced JSON form: the same calls whole, split anywhere and
    streamed, whose streamed arguments add up to the whole ones."""
    for cut in range(len(text) + 1):
        p = parser()
        c1, k1 = p.feed(text[:cut])
        c2, k2 = p.feed(text[cut:])
        c3, k3 = p.finish()
        assert c1 + c2 + c3 == content, cut
        assert [(c.name, json.loads(c.arguments)) for c in k1 + k2 + k3] == expected, cut
    for pieces in [[text], list(text) + [""]]:
        got_content, calls, _ = stream_calls(pieces, parser)
        assert got_content == content
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == expected


@pytest.mark.parametrize("parser, text, name, arguments", [
    (HermesToolParser, 'Hi.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "get_weather",
     '{"city": "Pa'),
    (Llama3JsonToolParser, '{"name": "a", "parameters": {}}; {"name": "get_weather", "parameters": {"ci',
     "get_weather", '{"ci'),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"city": ', "get_weather", '{"city":'),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "P', "get_weather",
     '{"city": "P'),
    (ForcedJsonToolParser, '[{"name": "get_weather", "parameters": {"city": "Paris", "da', "get_weather",
     '{"city": "Paris", "da'),
])
def test_a_call_cut_off_keeps_what_was_written_and_no_markup(parser, text, name, arguments):
    """The output ended inside a call (max_tokens): the call as far as it was written, whole or
    streamed, and no markup in the content."""
    p = parser()
    content, calls = p.feed(text)
    rest, more = p.finish()
    calls += more
    assert content + rest in ("", "Hi.")
    assert (calls[-1].name, calls[-1].arguments) == (name, arguments)
    streamed_content, streamed, _ = stream_calls(list(text) + [""], parser)
    assert streamed_content == content + rest
    last = streamed[max(streamed)]
    assert (last["name"], last["arguments"]) == (name, arguments)
    p = parser()
    p.feed(text[:text.index(name) + 3])  # the name itself cut off: nothing to return
    assert p.finish()[0] in ("", "Hi.") and [c.name for c in p.calls if c.name == name] == []


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
