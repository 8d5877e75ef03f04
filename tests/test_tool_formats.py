"""Tool calling by default: the tool-call and reasoning parsers chosen from the chat template
(``auto``), forced calls in every format (the format's own grammar, or the plain JSON form where
it has none), and a call cut off by max_tokens. The templates in tests/data are written for these
tests in the shapes of Qwen2.5's (hermes), Qwen3.5's (XML), Llama 3.1's and Mistral's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from anna.core.sampling_params import StructuredOutputsParams
from anna.server.app import create_app
from anna.server.tool_parsers import ForcedJsonToolParser, Llama3JsonToolParser, forced_call_parser
from anna.weights.chat_template import template_reasoning_format, template_tool_format
from anna.weights.demo_model import CHATML
from conftest import engine_settings

DATA = Path(__file__).parent / "data"
TEMPLATES = {"hermes": "hermes_style_chat_template.jinja", "qwen3_xml": "qwen3_5_style_chat_template.jinja",
             "llama3_json": "llama3_style_chat_template.jinja", "mistral": "mistral_style_chat_template.jinja"}
SCHEMA = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "units": {"enum": ["metric", "imperial"]}},
          "required": ["days", "units"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("parser", sorted(TEMPLATES))
def test_the_parser_is_read_from_the_chat_template(parser):
    template = (DATA / TEMPLATES[parser]).read_text()
    assert template_tool_format(template)[0] == parser
    assert template_reasoning_format(template)[0] == ("think" if parser == "qwen3_xml" else "none")
    assert template_tool_format(CHATML)[0] == "none" and template_tool_format(None)[0] == "none"
    # a template that fails on a rendered call is still read from its text
    failing = "{% if messages[1].tool_calls %}{{ raise_exception('no') }}{% endif %}<tool_call>"
    assert template_tool_format(failing)[0] == "hermes"


def test_forced_grammars_of_the_json_formats(grammar_checker):
    """Llama 3 JSON forces its own form; mistral and none force the plain JSON list."""
    def accepts(grammar: str, text: str) -> bool:
        return grammar_checker(StructuredOutputsParams(grammar=grammar), text)

    call = '{"name": "get_weather", "parameters": {"days": 3, "units": "metric"}}'
    grammar = Llama3JsonToolParser.grammar(TOOLS, parallel=True)
    assert accepts(grammar, call) and accepts(grammar, call + '; {"name": "add", "parameters": {"a": 4}}')
    assert not accepts(grammar, call.replace("3", "30"))  # days above the schema's maximum
    assert not accepts(Llama3JsonToolParser.grammar(TOOLS, parallel=False), call + "; " + call)
    for name in ("mistral", "none"):
        cls, grammar = forced_call_parser(name, TOOLS, parallel=False)
        assert cls is ForcedJsonToolParser
        assert accepts(grammar, f"[{call}]") and not accepts(grammar, f"[{call}, {call}]")
        assert not accepts(grammar, "[]") and not accepts(grammar, call)
    assert accepts(forced_call_parser("none", TOOLS, parallel=True)[1], f"[{call}, {call}]")


def _serve(app, script):
    """Run ``script(post)`` against the app in process; ``post(body)`` is a chat completion's JSON."""
    import httpx

    async def go():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                async def post(body: dict) -> dict:
                    return (await client.post("/v1/chat/completions", json=body)).json()
                return await script(post)
    return asyncio.run(go())


@pytest.mark.parametrize("parser", [*sorted(TEMPLATES), "none"])
def test_forced_calls_with_the_parser_auto_chose(parser, roomy_qwen2_dir, cache_dir):
    """`anna serve` with no parser flags: the settings name the format the template writes, and
    forced calls (required, a named function) come back as tool_calls that follow the schemas, in
    every format. The same call cut off by max_tokens just after its name gives finish_reason
    length and the call as far as it was written, never markup as content; cut before its name
    was written, no call and no content."""
    template = str(DATA / TEMPLATES[parser]) if parser != "none" else CHATML
    app = create_app(engine_settings(roomy_qwen2_dir, cache_dir, chat_template=template, inference_warmup=False,
                                     max_model_len=1024), load_in_background=False)
    base = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 1.0,
            "chat_template_kwargs": {"enable_thinking": False}}
    named = {**base, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 1}

    async def script(post):
        answers = [await post({**base, "tool_choice": "required", "parallel_tool_calls": False, "seed": seed})
                   for seed in range(3)]
        answers.append(await post({**base, "tool_choice": {"type": "function", "function": {"name": "add"}},
                                   "seed": 7}))
        whole = await post({**named, "logprobs": True})
        pieces = [t["token"] for t in whole["choices"][0]["logprobs"]["content"]]
        name_end = "".join(pieces).index("get_weather") + len("get_weather") + 1  # and its closing quote or >
        after_name = next(k for k in range(len(pieces)) if len("".join(pieces[:k])) >= name_end)
        cuts = [await post({**named, "max_tokens": n}) for n in (after_name, 1)]
        return answers + [whole], cuts

    answers, (cut, early) = _serve(app, script)
    settings = app.state.anna.core.settings
    assert settings.tool_call_parser == parser and "auto" in settings.sources["tool_call_parser"]
    row = next(line for line in settings.table().splitlines() if line.split()[0] == "tool_call_parser")
    assert repr(parser) in row and "auto, " in row  # the start-up table names the choice and why
    assert settings.reasoning_parser == ("think" if parser == "qwen3_xml" else "none")
    for answer in answers:
        assert "choices" in answer, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", answer
        (call,) = choice["message"]["tool_calls"]
        tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    assert answers[3]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add"
    whole_arguments = answers[4]["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    for answer in (cut, early):
        assert answer["choices"][0]["finish_reason"] == "length", answer
        assert not answer["choices"][0]["message"]["content"], answer
    (call,) = cut["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = call["function"]["arguments"]  # JSON text as far as written (XML: the parameters complete)
    assert whole_arguments.startswith(arguments) or json.loads(arguments).items() <= json.loads(whole_arguments).items()
    assert not early["choices"][0]["message"].get("tool_calls")
