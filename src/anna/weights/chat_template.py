"""Render a model's chat template in jinja2's sandbox.

Templates come from downloaded files, so they run in an ImmutableSandboxedEnvironment: no access
to Python internals, no mutation of the objects passed in. Models without a template get ChatML.
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template failed on these messages (raise_exception in the template, or a template bug)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False,
            separators: Any = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from None


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or inline (vLLM's --chat-template); checked to compile."""
    try:
        is_file = Path(value).expanduser().is_file()
    except OSError:  # an inline template longer than a file name may be
        is_file = False
    if is_file:
        template = Path(value).expanduser().read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    try:
        _compile(template)
    except ChatTemplateError as exc:
        raise ValueError(f"chat_template: {exc}") from None
    return template


# Template variables that come from their own arguments, never from chat_template_kwargs
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools")


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """ValueError naming chat_template_kwargs if it would set a variable that has its own field."""
    for name in RESERVED_TEMPLATE_VARIABLES:
        if name in kwargs:
            raise ValueError(f"chat_template_kwargs: {name!r} may not be given here; it comes from the "
                             f"request's own {name!r}")


def render_chat(template: str | None, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, special_tokens: dict[str, str | None] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """``template_kwargs`` are extra template variables (chat_template_kwargs); as in vLLM they may
    override add_generation_prompt and the special tokens, but not the messages or the tools."""
    check_template_kwargs(template_kwargs or {})
    compiled = _compile(template or CHATML_TEMPLATE)
    variables = {"add_generation_prompt": add_generation_prompt, **(special_tokens or {}), **(template_kwargs or {}),
                 "messages": messages, "tools": tools}
    try:
        return compiled.render(**variables)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"chat template tried an unsafe operation: {exc}") from None
    except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
        raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None


# A conversation with one tool call, rendered to see how a template writes calls.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "d",
                                                "parameters": {"type": "object",
                                                               "properties": {"probe_arg": {"type": "string"}}}}}
_PROBE_MESSAGES = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe0001", "type": "function", "function": {
        "name": "probe_tool", "arguments": {"probe_arg": "v"}}}]},
    {"role": "tool", "tool_call_id": "call_probe0001", "content": "r"},
]


def template_tool_format(template: str | None) -> tuple[str, str]:
    """The tool-call format a chat template teaches its model (a --tool-call-parser name, or none),
    and what showed it: a conversation with one call is rendered and the call's markup looked for,
    then the template's own text (a template may render calls only for some message shapes)."""
    try:
        rendered = render_chat(template, _PROBE_MESSAGES, tools=[_PROBE_TOOL])
    except ChatTemplateError:
        rendered = ""
    source = template or ""
    for text, where in ((rendered, "a rendered call"), (source, "the template's text")):
        if "<function=probe_tool>" in text or ("<function=" in text and "<parameter=" in text):
            return "qwen3_xml", f"{where} has <tool_call><function=...><parameter=...>"
        if "<tool_call>" in text:
            return "hermes", f"{where} has <tool_call>{{json}}"
        if "[TOOL_CALLS]" in text:
            return "mistral", f"{where} has [TOOL_CALLS]"
        if "<|python_tag|>" in text or ('"name": "probe_tool"' in text and '"parameters"' in text):
            return "llama3_json", f'{where} has {{"name": ..., "parameters": ...}} (Llama 3)'
    return "none", "the chat template shows no tool-call format"


def template_reasoning_format(template: str | None) -> tuple[str, str]:
    """The reasoning parser a chat template calls for (think, or none), and why."""
    if template and "<think>" in template:
        return "think", "the chat template has <think>"
    return "none", "the chat template has no <think>"
