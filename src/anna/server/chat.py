"""Chat messages as real clients send them -> the prompt text the model's template makes of them."""

from __future__ import annotations

import json
from typing import Any

from anna.server.protocol import APIError, ChatCompletionRequest, ChatMessage, TokenizeRequest
from anna.weights.chat_template import ChatTemplateError, check_template_kwargs, render_chat
from anna.weights.tokenizer import Tokenizer

NON_TEXT_PARTS = {"image_url", "image", "input_image", "input_audio", "audio", "audio_url", "video_url", "file"}


def _content_text(content: str | list[dict[str, Any]] | None, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if not isinstance(kind, str):
            raise APIError(400, f"messages[{index}].content: each part needs a string 'type' (got {kind!r})",
                           param=f"messages[{index}].content")
        if kind in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{index}].content: a '{kind}' part needs a string 'text'",
                               param=f"messages[{index}].content")
            texts.append(part["text"])
        elif kind in NON_TEXT_PARTS:
            raise APIError(400, f"messages[{index}].content: '{kind}' parts are not supported: this model takes "
                                "text only", param=f"messages[{index}].content")
        else:
            raise APIError(400, f"messages[{index}].content: unknown content part type {kind!r}",
                           param=f"messages[{index}].content")
    return "\n".join(texts)


def _arguments(value: str | dict[str, Any]) -> Any:
    """Templates expect arguments as an object; clients send a JSON string (OpenAI) or an object."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _content_text(m.content, i)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": tc.id, "type": "function",
                                  "function": {"name": tc.function.name,
                                               "arguments": _arguments(tc.function.arguments)}}
                                 for tc in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def _merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All system messages joined into one, placed first."""
    system = [m["content"] or "" for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def _system_into_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that take no system role: prepend the system text to the first user message."""
    merged = _merge_system(messages)
    if not merged or merged[0]["role"] != "system":
        return merged
    system, rest = merged[0]["content"], [dict(m) for m in merged[1:]]
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{system}\n\n{m['content'] or ''}"
            return rest
    return [{"role": "user", "content": system}] + rest


def render_chat_request(tok: Tokenizer, req: ChatCompletionRequest | TokenizeRequest,
                        tools: list[dict[str, Any]] | None) -> str:
    messages = to_template_messages(req.messages)
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        check_template_kwargs(kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="chat_template_kwargs") from None
    add_generation_prompt = req.add_generation_prompt and not req.continue_final_message
    special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    error: ChatTemplateError | None = None
    for attempt in (messages, _merge_system(messages), _system_into_user(messages)):
        try:
            text = render_chat(tok.chat_template, attempt, add_generation_prompt=add_generation_prompt,
                               tools=tools, special_tokens=special, template_kwargs=kwargs)
        except ChatTemplateError as exc:
            error = error or exc
            continue
        if req.continue_final_message and attempt and attempt[-1]["content"]:
            final = attempt[-1]["content"]
            cut = text.rfind(final)
            if cut != -1:
                text = text[:cut + len(final)]
        return text
    raise APIError(400, f"messages: {error}", param="messages")
