"""Reasoning and tool-call parsing for the Qwen3.5 family: the chat template opens <think> in the
prompt (so only </think> appears in the output), and tool calls come in the XML form
<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>. The template
here (tests/data/qwen3_5_style_chat_template.jinja) renders prompts and past calls in that shape."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from anna.core.sampling_params import StructuredOutputsParams
from anna.server.constraints import after_reasoning
from anna.server.reasoning import ThinkReasoningParser, prompt_reasoning
from anna.server.tool_parsers import Qwen3XmlToolParser, ToolCallStreamer, parse_tool_calls
from anna.weights.chat_template import render_chat
from conftest import launch_server, stop_server

TEMPLATE = Path(__file__).parent / "data" / "qwen3_5_style_chat_template.jinja"
FORECAST = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["metric", "imperial"]},
    "detailed": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}}},
    "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": FORECAST}},
         {"type": "function", "function": {"name": "note", "parameters": {
             "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=units>\nmetric\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n"
        "<parameter=hours>\n[6, 12]\n</parameter>\n</function>\n</tool_call>")
NOTE = "<tool_call>\n<function=note>\n<parameter=text>\nline one\nline <two>\n</parameter>\n</function>\n</tool_call>"
ARGS = {"city": "São Paulo", "days": 3, "units": "metric", "detailed": True, "hours": [6, 12]}


def rendered(messages, **kwargs) -> str:
    return render_chat(TEMPLATE.read_text(), messages, tools=TOOLS, template_kwargs=kwargs)


def test_the_template_opens_reasoning_in_the_prompt_unless_thinking_is_off():
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert rendered(messages).endswith("<|im_start|>assistant\n<think>\n")
    assert prompt_reasoning(rendered(messages)) == "open"
    assert prompt_reasoning(rendered(messages, enable_thinking=False)) == "closed"
    past = messages + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nSunny."},
                       {"role": "user", "content": "And tomorrow?"}]
    assert prompt_reasoning(rendered(past)) == "open"  # a closed block earlier in the conversation does not count
    assert prompt_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") == "none"


@pytest.mark.parametrize("prompt", ["open", "none"])
def test_reasoning_then_content_at_every_chunk_size(prompt):
    """Opened by the prompt, the output is reasoning up to </think>; otherwise it must open the
    block itself. Either way the pieces add up to the same split."""
    output = ("" if prompt == "open" else "<think>\n") + "The user wants </thi the forecast.\n</think>\n\nIt is sunny."
    for step in (1, 2, 3, 5, 8, len(output)):
        parser = ThinkReasoningParser(prompt)
        pieces = [parser.feed(output[i:i + step]) for i in range(0, len(output), step)] + [parser.finish()]
        reasoning, content = "".join(r for r, _ in pieces), "".join(c for _, c in pieces)
        assert reasoning.strip() == "The user wants </thi the forecast."
        assert content == "It is sunny."


def test_opened_reasoning_cut_off_is_all_reasoning_and_a_closed_one_leaves_content():
    parser = ThinkReasoningParser("open")
    assert parser.feed("still thinking about") == ("still thinking about", "")
    assert parser.finish() == ("", "")
    assert ThinkReasoningParser("none").feed("plain answer") == ("", "plain answer")
    assert ThinkReasoningParser("closed").feed("<think>not a block</think>") == ("", "<think>not a block</think>")


def test_xml_calls_parse_with_the_types_their_schemas_give():
    content, calls = parse_tool_calls("Let me check.\n\n" + CALL + "\n" + NOTE, "qwen3_xml", TOOLS)
    assert content == "Let me check.\n\n"
    assert [c.name for c in calls] == ["get_weather", "note"]
    assert json.loads(calls[0].arguments) == ARGS
    assert json.loads(calls[1].arguments) == {"text": "line one\nline <two>"}
    # without the tool definitions every parameter is text, as vLLM's parser reads them
    assert json.loads(parse_tool_calls(CALL, "qwen3_coder")[1][0].arguments)["days"] == "3"


def test_malformed_and_unterminated_calls():
    broken = "<tool_call>\nnot a function\n</tool_call>"
    assert parse_tool_calls(broken, "qwen3_xml", TOOLS) == (broken, [])
    cut = CALL[:-len("</tool_call>")]  # max_tokens ended it after </function>: still a whole call
    content, calls = parse_tool_calls(cut, "qwen3_xml", TOOLS)
    assert content == "" and json.loads(calls[0].arguments) == ARGS
    cut = CALL[:CALL.index("</function>")]  # cut inside: the call as far as it was written, no markup
    content, calls = parse_tool_calls(cut, "qwen3_xml", TOOLS)
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == ARGS
    cut = CALL[:CALL.index("\n3\n")]  # inside a parameter: the parameters written whole so far
    content, calls = parse_tool_calls(cut, "qwen3_xml", TOOLS)
    assert content == "" and json.loads(calls[0].arguments) == {"city": "São Paulo"}
    assert parse_tool_calls("Hm. <tool_call>\n<func", "qwen3_xml", TOOLS) == ("Hm. ", [])  # no name yet


def test_streamed_xml_calls_add_up_at_every_chunk_size():
    text = "Checking." + CALL + "\n" + NOTE
    for step in (1, 2, 3, 7, 16, len(text)):
        streamer = ToolCallStreamer(Qwen3XmlToolParser(TOOLS))
        content, deltas = "", []
        for i in range(0, len(text), step):
            c, d = streamer.feed(text[i:i + step], final=i + step >= len(text))
            content, deltas = content + c, deltas + d
        assert content == "Checking."
        by_index: dict[int, dict] = {}
        for d in deltas:
            entry = by_index.setdefault(d["index"], {"name": None, "arguments": ""})
            entry["name"] = d["function"].get("name") or entry["name"]
            entry["arguments"] += d["function"].get("arguments", "")
            assert ("id" in d) == (entry["name"] == d["function"].get("name") and "name" in d["function"])
        assert [e["name"] for e in by_index.values()] == ["get_weather", "note"]
        assert json.loads(by_index[0]["arguments"]) == ARGS
        assert json.loads(by_index[1]["arguments"]) == {"text": "line one\nline <two>"}


@pytest.fixture
def accepts(grammar_checker):
    return grammar_checker


def test_forced_call_grammar_takes_calls_that_follow_the_schemas(accepts):
    spec = StructuredOutputsParams(grammar=Qwen3XmlToolParser.grammar(TOOLS, parallel=True))
    assert accepts(spec, CALL) and accepts(spec, CALL + "\n" + NOTE)
    minimal = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n" \
              "</parameter>\n</function>\n</tool_call>"
    assert accepts(spec, minimal)
    assert not accepts(spec, minimal.replace("\n2\n", "\ntwo\n"))  # days must be an integer
    assert not accepts(spec, minimal.replace("<parameter=city>\nRome\n</parameter>\n", ""))  # required
    assert not accepts(spec, "Sure." + CALL)
    assert not accepts(spec, CALL.replace("\nmetric\n", "\nkelvin\n"))  # not one of the enum's
    single = StructuredOutputsParams(grammar=Qwen3XmlToolParser.grammar(TOOLS, parallel=False))
    assert not accepts(single, CALL + "\n" + NOTE)
    # after the reasoning block the prompt opened: reasoning text, </think>, then the call
    opened = after_reasoning(spec, "open")
    assert accepts(opened, "which tool? </th not yet\n</think>\n\n" + CALL)
    assert not accepts(opened, CALL)  # the block is open: it must be closed first
    assert accepts(after_reasoning(spec), CALL)
    assert after_reasoning(spec, "closed") is spec  # the prompt gave the (empty) block: the call comes first


def test_server_forces_xml_calls_and_splits_opened_reasoning(hf_models, cache_dir, tmp_path):
    """`anna serve` on a tiny Qwen3.5 with this template and no parser flags (auto reads qwen3_xml
    and think from the template): a forced call comes back as tool_calls whose arguments follow the
    schema; a plain answer to a prompt that opened <think> is reasoning_content (the random model
    never closes it), and with thinking off it is content."""
    _, path = hf_models["qwen3_5"]
    proc, base = launch_server(path, cache_dir, tmp_path / "server.log", "--chat-template", str(TEMPLATE),
                               "--num-gpu-blocks-override", "64")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        # (typed parameters: a random model seldom writes the closing tag of free text; and the
        # tiny model's context is 512 tokens)
        small = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9},
                                                  "units": {"enum": ["metric", "imperial"]}},
                 "required": ["days", "units"]}
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": small}}]
        for seed in range(3):
            r = client.chat.completions.create(
                model=client.models.list().data[0].id, messages=messages, tools=tools,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=seed, max_tokens=120,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
            jsonschema.validate(json.loads(calls[0].function.arguments), small)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, seed=1,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].message.reasoning_content and not r.choices[0].message.content
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, seed=1,
                                           extra_body={"ignore_eos": True,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].message.content and r.choices[0].message.reasoning_content is None
    finally:
        stop_server(proc)
