"""Tool calls in model output -> OpenAI tool_calls, whole or incrementally while streaming.

The Hermes format (used by Qwen2.5/Qwen3 and Hermes models):
``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>``. Text outside the tags is content.
While streaming, text that could be the start of an opening tag is held back until it is decided.
"""

from __future__ import annotations

import json
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


class HermesToolParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""  # undecided text
        self.in_call = False
        self.calls: list[ParsedToolCall] = []

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

    def _parse(self, body: str) -> ParsedToolCall | None:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

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
        """End of output: an unterminated call is parsed if it is complete JSON, else returned as text."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            call = self._parse(rest)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return self.OPEN + rest, []
        return ("" if self.calls and not rest.strip() else rest), []


TOOL_PARSERS = {"hermes": HermesToolParser}


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str, list[ParsedToolCall]]:
    p = TOOL_PARSERS[parser]()
    content, calls = p.feed(text)
    rest, more = p.finish()
    return content + rest, calls + more
