"""Tool calls in model output -> OpenAI tool_calls, whole or incrementally while streaming.

Two formats, both inside ``<tool_call>...</tool_call>`` tags (text outside them is content):
- hermes (Qwen2.5/Qwen3 and Hermes models): ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``
- qwen3_xml (Qwen3.5, Qwen3-Coder; vLLM's qwen3_coder / qwen3_xml):
  ``<tool_call>\n<function=f>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>``;
  a parameter's text is converted by the type its tool's schema gives it (strings stay text).
While streaming, text that could be the start of an opening tag is held back until it is decided.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from anna.runtime.structured_output import JSON_OPTIONS


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _longest_partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TaggedToolParser:
    """Calls between OPEN and CLOSE tags; subclasses read a call's body (``_parse``, ``open_call``)
    and write the grammar that forces calls (``grammar``)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.buffer = ""  # undecided text
        self.in_call = False
        self.calls: list[ParsedToolCall] = []
        self.tools = tools or []  # OpenAI tool definitions: the parameter types, where a format needs them

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        raise NotImplementedError

    def _parse(self, body: str) -> ParsedToolCall | None:
        raise NotImplementedError

    def open_call(self) -> tuple[str, str] | None:
        """While inside a call: its name and the arguments text so far that is surely part of them."""
        raise NotImplementedError

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Consume new output text; return (content to emit now, tool calls completed now)."""
        self.buffer += delta
        content, calls = [], []
        while True:
            if not self.in_call:
                after_call = bool(self.calls or calls)  # whitespace between calls is not content
                idx = self.buffer.find(self.OPEN)
                if idx == -1:
                    keep = _longest_partial_suffix(self.buffer, self.OPEN)
                    if after_call and not self.buffer[:len(self.buffer) - keep].strip():
                        keep = len(self.buffer)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                if not (after_call and not self.buffer[:idx].strip()):
                    content.append(self.buffer[:idx])
                self.buffer = self.buffer[idx + len(self.OPEN):]
                self.in_call = True
            else:
                idx = self.buffer.find(self.CLOSE)
                if idx == -1:
                    break
                body = self.buffer[:idx]
                self.buffer = self.buffer[idx + len(self.CLOSE):]
                self.in_call = False
                call = self._parse(body)
                if call is None:  # not a valid call: keep the text as the model wrote it
                    content.append(self.OPEN + body + self.CLOSE)
                else:
                    calls.append(call)
        self.calls.extend(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """End of output: an unterminated call is parsed if it is complete, else returned as text."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            call = self._parse(rest)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return self.OPEN + rest, []
        return ("" if self.calls and not rest.strip() else rest), []


class HermesToolParser(TaggedToolParser):
    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar whose sentences are calls, in this format, to these tools (OpenAI tool
        definitions) with arguments that follow each tool's parameters schema: what
        ``tool_choice: "required"`` or a named function enforces. One call, or several when parallel."""
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "arguments": t["function"].get("parameters") or {"type": "object"}}}
                 for t in tools]
        schema = {"anyOf": calls, "x-guidance": JSON_OPTIONS}
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return (f"{start}\n"
                f'call: {json.dumps(cls.OPEN + chr(10))} body {json.dumps(chr(10) + cls.CLOSE)}\n'
                f"body: %json {json.dumps(schema)}\n")

    # The usual layout of a call body, up to where its arguments begin: what lets a stream send the
    # name first and then the arguments as they are written.
    HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    def _parse(self, body: str) -> ParsedToolCall | None:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            return ParsedToolCall(obj["name"], args)
        raw = self._raw_arguments(body)  # the model's own text, so that a stream's pieces add up to it
        return ParsedToolCall(obj["name"], raw if raw is not None else json.dumps(args, ensure_ascii=False))

    @classmethod
    def _raw_arguments(cls, body: str) -> str | None:
        m = cls.HEADER.match(body)
        rest = body[m.end():].rstrip() if m else ""
        if not rest.endswith("}"):
            return None
        raw = rest[:-1].rstrip()
        try:
            json.loads(raw)
        except json.JSONDecodeError:  # more keys after "arguments": not the usual layout
            return None
        return raw

    def open_call(self) -> tuple[str, str] | None:
        """While inside a call: its name and the arguments text so far that is surely part of them
        (the end of the buffer may yet turn out to be the body's closing brace or the close tag)."""
        if not self.in_call:
            return None
        m = self.HEADER.match(self.buffer)
        if m is None:
            return None
        text = self.buffer[m.end():].rstrip()
        text = text[:len(text) - _longest_partial_suffix(text, self.CLOSE)].rstrip()
        if text.endswith("}"):
            text = text[:-1].rstrip()
        try:
            name = json.loads(f'"{m.group(1)}"')
        except json.JSONDecodeError:
            return None
        return name, text

class Qwen3XmlToolParser(TaggedToolParser):
    FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)
    FUNCTION_END = "</function>"
    # a string parameter's text in a forced call: free, up to the tag that closes it
    TEXT = 'text[stop="\\n</parameter>"]: /(.|\\n)*/'

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        """Calls to these tools in this format, each with its required parameters (and any of its
        optional ones) in schema order; typed parameters are JSON that follows their schema."""
        rules = ['start: call ("\\n" call)*' if parallel else "start: call",
                 "call: " + " | ".join(f"call{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            fn = tool["function"]
            schema = fn.get("parameters") or {}
            props, required = schema.get("properties") or {}, set(schema.get("required") or [])
            parts = []
            for j, (key, prop) in enumerate(props.items()):
                opening = json.dumps(f"<parameter={key}>\n")
                choices = _text_choices(prop)
                if choices:
                    rules.append(f'param{i}_{j}: {opening} ({" | ".join(json.dumps(c) for c in choices)}) '
                                 '"\\n</parameter>\\n"')
                elif _is_text(prop):
                    rules.append(f'param{i}_{j}: {opening} text "\\n"')
                else:
                    rules.append(f'param{i}_{j}: {opening} %json {json.dumps(prop)} "\\n</parameter>\\n"')
                parts.append(f"param{i}_{j}" + ("" if key in required else "?"))
            head = json.dumps(f"{cls.OPEN}\n<function={fn['name']}>\n")
            tail = json.dumps(f"{cls.FUNCTION_END}\n{cls.CLOSE}")
            rules.append(f"call{i}: {head} {' '.join(parts)} {tail}")
        rules.append(cls.TEXT)
        return "\n".join(rules) + "\n"

    def _schemas(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool.get("function", {}).get("name") == name:
                return (tool["function"].get("parameters") or {}).get("properties") or {}
        return {}

    def _value(self, schema: dict[str, Any] | None, raw: str) -> Any:
        """A parameter's text as its schema's type says (without a schema: text); text that does
        not parse stays text."""
        if schema is None or _is_text(schema):
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def _parameters(self, name: str, text: str) -> dict[str, Any]:
        schemas = self._schemas(name)
        return {m.group(1).strip(): self._value(schemas.get(m.group(1).strip()), m.group(2))
                for m in self.PARAMETER.finditer(text)}

    def _parse(self, body: str) -> ParsedToolCall | None:
        m = self.FUNCTION.match(body)
        end = body.rfind(self.FUNCTION_END)
        if m is None or end < m.end():
            return None
        args = self._parameters(m.group(1).strip(), body[m.end():end])
        return ParsedToolCall(m.group(1).strip(), json.dumps(args, ensure_ascii=False))

    def open_call(self) -> tuple[str, str] | None:
        """The name, and the arguments JSON of the parameters complete so far, without its closing
        brace (the final arguments are ``json.dumps`` of all of them: this is their prefix)."""
        if not self.in_call:
            return None
        m = self.FUNCTION.match(self.buffer)
        if m is None:
            return None
        name = m.group(1).strip()
        args = self._parameters(name, self.buffer[m.end():])
        return name, json.dumps(args, ensure_ascii=False)[:-1]


def _text_choices(schema: dict[str, Any]) -> list[str]:
    """The values of an enum / const of strings (written as plain text), else none."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    return values if values and all(isinstance(v, str) for v in values) else []


def _is_text(schema: dict[str, Any]) -> bool:
    """Whether a parameter is written as plain text (a string type, or an enum / const of strings)
    rather than as JSON."""
    kind = schema.get("type")
    if kind is None:
        return bool(_text_choices(schema))
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


TOOL_PARSERS = {"hermes": HermesToolParser, "qwen3_xml": Qwen3XmlToolParser, "qwen3_coder": Qwen3XmlToolParser}
TOOL_GRAMMAR_START = "start: call"  # how every parser's forced-call grammar begins


class ToolCallStreamer:
    """A parser's progress as OpenAI stream deltas: each call's id and name as soon as they are
    known, then its arguments piece by piece. A call in another layout is sent whole when it ends."""

    def __init__(self, parser: TaggedToolParser) -> None:
        self.parser = parser
        self.count = 0  # calls given an index so far
        self.open_index: int | None = None  # the call whose arguments are streaming
        self.sent = ""  # its arguments sent so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        content, done = self.parser.feed(text)
        if final:
            rest, more = self.parser.finish()
            content, done = content + rest, done + more
        deltas: list[dict[str, Any]] = []
        for call in done:
            if self.open_index is not None:
                if call.arguments.startswith(self.sent) and len(call.arguments) > len(self.sent):
                    deltas.append({"index": self.open_index, "function": {"arguments": call.arguments[len(self.sent):]}})
                self.open_index, self.sent = None, ""
            else:
                deltas.append(call.to_openai(self._next_index()))
        current = None if final else self.parser.open_call()
        if current is None:
            self.open_index, self.sent = None, ""  # also drops a started call that turned out invalid
            return content, deltas
        name, arguments = current
        if self.open_index is None:
            self.open_index = self._next_index()
            deltas.append({"index": self.open_index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": name, "arguments": ""}})
        if len(arguments) > len(self.sent) and arguments.startswith(self.sent):
            deltas.append({"index": self.open_index, "function": {"arguments": arguments[len(self.sent):]}})
            self.sent = arguments
        return content, deltas

    def _next_index(self) -> int:
        self.count += 1
        return self.count - 1


def parse_tool_calls(text: str, parser: str = "hermes",
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedToolCall]]:
    p = TOOL_PARSERS[parser](tools)
    content, calls = p.feed(text)
    rest, more = p.finish()
    return content + rest, calls + more
