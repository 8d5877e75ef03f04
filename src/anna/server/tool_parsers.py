"""Tool calls in model output -> OpenAI tool_calls, whole or incrementally while streaming.

The formats chat templates teach their models (``--tool-call-parser``; ``auto`` reads the
template, weights.chat_template.template_tool_format):
- hermes (Qwen2.5/Qwen3 and Hermes models): ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``
- qwen3_xml (Qwen3.5, Qwen3-Coder; vLLM's qwen3_coder / qwen3_xml):
  ``<tool_call>\n<function=f>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>``;
  a parameter's text is converted by the type its tool's schema gives it (strings stay text).
- llama3_json (Llama 3.1-3.3): the whole answer is ``{"name": "f", "parameters": {...}}`` (several
  joined by ``;``), optionally after ``<|python_tag|>``.
- mistral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` or, in newer templates,
  ``[TOOL_CALLS]f[ARGS]{...}`` per call.
A call forced where the format has no grammar (``none``, mistral) is written in a plain JSON form
(ForcedJsonToolParser), as vLLM forces calls. Text outside calls is content. While streaming,
text that could be the start of a call is held back until it is decided. A call the output cut
off (max_tokens) comes back as far as it was written, never as raw markup in the content.
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
    arguments: str  # a JSON string, as OpenAI returns it (as far as written, for a call cut off)
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


# The usual layout of a JSON call up to where its arguments begin: what lets a stream send the name
# first and the arguments as they are written, and a call cut off keep what it wrote.
JSON_CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
JSON_CALL_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _arguments_text(text: str, start: int) -> tuple[str, bool]:
    """The arguments value that starts at ``start`` as the model wrote it, and whether it is whole
    (else: as far as written)."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
        return text[start:end], True
    except json.JSONDecodeError:
        return text[start:].rstrip(), False


def _call_from_json(obj: Any, text: str) -> ParsedToolCall | None:
    """A decoded ``{"name": ..., "arguments" | "parameters": {...}}`` as a call (None if it is not
    one); ``text`` is the object as the model wrote it, whose arguments are kept verbatim when they
    come right after the name, so that a stream's pieces add up to them."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ParsedToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    m = JSON_CALL_NAME.match(text)
    m = JSON_CALL_ARGUMENTS.match(text, m.end()) if m else None
    if m is not None:
        raw, whole = _arguments_text(text, m.end())
        if whole and raw.startswith("{"):
            return ParsedToolCall(obj["name"], raw)
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def read_json_calls(text: str, separators: str = ";,") -> tuple[list[ParsedToolCall], str]:
    """The JSON calls at the start of ``text``, one after another (whitespace and ``separators``
    between them), and the text after the last whole one."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return calls, text[pos:]
        call = _call_from_json(obj, text[pos:end])
        if call is None:
            return calls, text[pos:]
        calls.append(call)
        pos = end


def partial_json_call(text: str) -> tuple[str, str] | None:
    """A JSON call being written (or cut off) whose name is written: the name and its arguments
    text so far (the whole value once it is complete, whatever follows it)."""
    m = JSON_CALL_NAME.match(text)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None
    key = JSON_CALL_ARGUMENTS.match(text, m.end())
    return name, _arguments_text(text, key.end())[0] if key else ""


def _forced_calls_schema(tools: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One call to one of these tools (OpenAI tool definitions) as a JSON object whose arguments,
    under ``key``, follow that tool's parameters schema."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", key],
              "properties": {"name": {"const": t["function"]["name"]},
                             key: t["function"].get("parameters") or {"type": "object"}}}
             for t in tools]
    return {"anyOf": calls, "x-guidance": JSON_OPTIONS}


class ToolParser:
    """One choice's output, fed as it is written, split into content and tool calls.

    ``grammar`` is the Lark grammar that forces calls in the format (``tool_choice: "required"``
    or a named function); a format without one has its forced calls written in ForcedJsonToolParser's
    form. ``KEEPS_SPECIAL_TOKENS``: its markers are special tokens, which the text must keep."""

    KEEPS_SPECIAL_TOKENS = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.buffer = ""  # text not yet decided
        self.in_call = False
        self.calls: list[ParsedToolCall] = []
        self.tools = tools or []  # OpenAI tool definitions: the parameter types, where a format needs them

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str | None:
        """Sentences that are calls to these tools, in this format, with arguments that follow each
        tool's parameters schema: one call, or several when parallel. None: the format has none."""
        return None

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Consume new output text; return (content to emit now, tool calls completed now)."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """End of output: (the content left, the calls completed now, with one cut off as far as it
        was written)."""
        raise NotImplementedError

    def open_call(self) -> tuple[str, str] | None:
        """While inside a call: its name and the arguments text so far that is surely part of them.
        None where the format sends its calls whole."""
        return None


class TaggedToolParser(ToolParser):
    """Calls between OPEN and CLOSE tags; subclasses read a call's body (``_parse``, ``_partial``)
    and write the grammar that forces calls (``grammar``)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _parse(self, body: str) -> ParsedToolCall | None:
        raise NotImplementedError

    def _partial(self, body: str, final: bool) -> tuple[str, str] | None:
        """The name and arguments so far of a call whose body is not complete (``final``: the
        output ended there)."""
        raise NotImplementedError

    def open_call(self) -> tuple[str, str] | None:
        return self._partial(self.buffer, final=False) if self.in_call else None

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
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
                if call is None:  # the model closed something that is not a call: keep its text
                    content.append(self.OPEN + body + self.CLOSE)
                else:
                    calls.append(call)
        self.calls.extend(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """An unterminated call is parsed if it is complete, else kept as far as its name and
        arguments were written; an open tag with no name yet is dropped."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            call = self._parse(rest)
            if call is None:
                partial = self._partial(rest, final=True)
                call = ParsedToolCall(*partial) if partial is not None else None
            if call is None:
                return "", []
            self.calls.append(call)
            return "", [call]
        return ("" if self.calls and not rest.strip() else rest), []


class HermesToolParser(TaggedToolParser):
    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        schema = _forced_calls_schema(tools, "arguments")
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return (f"{start}\n"
                f'call: {json.dumps(cls.OPEN + chr(10))} body {json.dumps(chr(10) + cls.CLOSE)}\n'
                f"body: %json {json.dumps(schema)}\n")

    def _parse(self, body: str) -> ParsedToolCall | None:
        calls, rest = read_json_calls(body, separators="")
        return calls[0] if len(calls) == 1 and not rest.strip() else None

    def _partial(self, body: str, final: bool) -> tuple[str, str] | None:
        return partial_json_call(body)


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

    def _partial(self, body: str, final: bool) -> tuple[str, str] | None:
        """The name, and the arguments JSON of the parameters complete so far: without its closing
        brace while the call goes on (the final arguments are ``json.dumps`` of all of them: this is
        their prefix), whole when the output ended inside the call."""
        m = self.FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        args = json.dumps(self._parameters(name, body[m.end():]), ensure_ascii=False)
        return name, args if final else args[:-1]


class TrailingToolParser(ToolParser):
    """Formats whose calls run from a start marker to the end of the output (Llama 3 JSON, Mistral):
    text before the marker is content; what follows it is read as calls when the output ends."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.no_calls = False  # decided: this output holds no calls
        self._read_cache: tuple[str, tuple[list[ParsedToolCall], tuple[str, str] | None]] | None = None

    def _start(self, text: str) -> int | None:
        """Where calls start in the undecided text: the marker's index, -1 not yet (all of the text
        but its last ``_undecided`` characters is content), None never in this output."""
        raise NotImplementedError

    def _undecided(self, text: str) -> int:
        """How much of the end of a text without a marker could still become one."""
        return 0

    def _read(self, text: str) -> tuple[list[ParsedToolCall], tuple[str, str] | None]:
        """The whole calls in the text from the marker on, and the name and arguments so far of one
        the output cut off."""
        raise NotImplementedError

    def _not_calls(self, text: str) -> str:
        """The content of text after a marker that held no call: none (it is markup)."""
        return ""

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self.buffer += delta
        if self.in_call:
            return "", self._completed()
        idx = None if self.no_calls else self._start(self.buffer)
        if idx is None:
            self.no_calls = True
            content, self.buffer = self.buffer, ""
        elif idx == -1:
            keep = self._undecided(self.buffer)
            content, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        else:
            content, self.buffer, self.in_call = self.buffer[:idx], self.buffer[idx:], True
            return content, self._completed()
        return content, []

    def _read_buffer(self) -> tuple[list[ParsedToolCall], tuple[str, str] | None]:
        """_read of the buffer, once per buffer (feed, then the streamer's open_call, read it)."""
        if self._read_cache is None or self._read_cache[0] != self.buffer:
            self._read_cache = (self.buffer, self._read(self.buffer))
        return self._read_cache[1]

    def _completed(self) -> list[ParsedToolCall]:
        """The calls the buffer completes beyond those already returned."""
        calls, _ = self._read_buffer()
        new = calls[len(self.calls):]
        self.calls.extend(new)
        return new

    def open_call(self) -> tuple[str, str] | None:
        if not self.in_call:
            return None
        calls, cut = self._read_buffer()
        return cut if len(calls) == len(self.calls) else None

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        calls, cut = self._read(rest)
        calls = calls[len(self.calls):]
        if cut is not None:  # as far as it was written
            calls.append(ParsedToolCall(*cut))
        if not calls and not self.calls:
            return self._not_calls(rest), []
        self.calls.extend(calls)
        return "", calls


class Llama3JsonToolParser(TrailingToolParser):
    """Llama 3.1-3.3: an answer that starts with ``{`` (or ``<|python_tag|>``) is calls; JSON that
    is not a call stays content, as the model wrote it."""

    PYTHON_TAG = "<|python_tag|>"
    KEEPS_SPECIAL_TOKENS = True

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        schema = _forced_calls_schema(tools, "parameters")
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return f"{start}\ncall: %json {json.dumps(schema)}\n"

    def _start(self, text: str) -> int | None:
        body = text.lstrip()
        if body.startswith((self.PYTHON_TAG, "{")):
            return len(text) - len(body)
        return -1 if self.PYTHON_TAG.startswith(body) else None  # (nothing but whitespace yet: -1)

    def _undecided(self, text: str) -> int:
        return len(text)

    def _read(self, text: str) -> tuple[list[ParsedToolCall], tuple[str, str] | None]:
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):]
        calls, tail = read_json_calls(body)
        return calls, partial_json_call(tail)

    def _not_calls(self, text: str) -> str:
        return text


class MistralToolParser(TrailingToolParser):
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    KEEPS_SPECIAL_TOKENS = True

    def _start(self, text: str) -> int | None:
        return text.find(self.START)

    def _undecided(self, text: str) -> int:
        return _longest_partial_suffix(text, self.START)

    def _read(self, text: str) -> tuple[list[ParsedToolCall], tuple[str, str] | None]:
        calls: list[ParsedToolCall] = []
        for part in text.split(self.START)[1:]:
            part = part.strip()
            if self.ARGS in part:  # name[ARGS]{...}
                name, _, args = part.partition(self.ARGS)
                try:
                    json.loads(args)
                except json.JSONDecodeError:
                    return calls, (name.strip(), args.strip())
                calls.append(ParsedToolCall(name.strip(), args.strip()))
            else:  # [{"name": ..., "arguments": ...}, ...]
                found, tail = read_json_calls(part[1:] if part.startswith("[") else part)
                calls += found
                if tail.strip() not in ("", "]"):
                    return calls, partial_json_call(tail)
        return calls, None


class ForcedJsonToolParser(TrailingToolParser):
    """Forced calls in a format-free form: the output is a JSON array of
    ``{"name": ..., "parameters": {...}}`` (what vLLM forces with no parser). Used for forced calls
    where the format has no grammar of its own (``none``, mistral)."""

    @classmethod
    def grammar(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        schema = {"type": "array", "minItems": 1, "items": _forced_calls_schema(tools, "parameters"),
                  "x-guidance": JSON_OPTIONS}
        if not parallel:
            schema["maxItems"] = 1
        return f"start: call\ncall: %json {json.dumps(schema)}\n"

    def _start(self, text: str) -> int | None:
        return 0

    def _read(self, text: str) -> tuple[list[ParsedToolCall], tuple[str, str] | None]:
        body = text.lstrip()
        calls, tail = read_json_calls(body[1:] if body.startswith("[") else body, separators=",")
        return calls, None if tail.strip() in ("", "]") else partial_json_call(tail)


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


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen3_xml": Qwen3XmlToolParser, "qwen3_coder": Qwen3XmlToolParser,
    "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}
TOOL_GRAMMAR_START = "start: call"  # how every forced-call grammar begins


def forced_call_parser(parser: str, tools: list[dict[str, Any]], parallel: bool) -> tuple[type[ToolParser], str]:
    """The parser that reads calls forced on output (tool_choice required or a named function), and
    the grammar that forces them: the format's own, or the plain JSON form where it has none."""
    cls = TOOL_PARSERS.get(parser, ForcedJsonToolParser)
    grammar = cls.grammar(tools, parallel)
    if grammar is None:
        cls, grammar = ForcedJsonToolParser, ForcedJsonToolParser.grammar(tools, parallel)
    return cls, grammar


class ToolCallStreamer:
    """A parser's progress as OpenAI stream deltas: each call's id and name as soon as they are
    known, then its arguments piece by piece. A call in another layout is sent whole when it ends."""

    def __init__(self, parser: ToolParser) -> None:
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
