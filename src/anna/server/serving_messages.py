"""POST /v1/messages and /v1/messages/count_tokens in Anthropic's shape (what Claude Code and
the anthropic SDK speak), on the same path as chat: the request becomes a chat request (system
prompt, text, tool_use and tool_result blocks, tools with their input schemas, tool_choice auto
/ any / tool / none), the answer is content blocks (thinking, text, tool_use) with Anthropic's
stop_reason and usage, whole or as its stream of events. Errors are Anthropic's error JSON."""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from anna.server.common import (ServerState, as_api_error, check_model, final_output, parse_body,
                                run_until_done, validate_body)
from anna.server.protocol import APIError, ChatCompletionRequest
from anna.server.serving_chat import ChatRun, chat_prompt_ids, parse_choice, start_chat


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[_Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str
    messages: list[AnthropicMessage]
    max_tokens: int = Field(ge=1)
    system: str | list[_Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[AnthropicMessage]
    system: str | list[_Block] | None = None
    tools: list[AnthropicTool] | None = None


def anthropic_error(err: APIError) -> Response:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
            429: "rate_limit_error", 503: "overloaded_error"}.get(err.status,
                                                                   "invalid_request_error" if err.status < 500
                                                                   else "api_error")
    return Response(json.dumps({"type": "error", "error": {"type": kind, "message": err.message}}),
                    status_code=err.status, media_type="application/json")


def _text_of(content: str | list[_Block], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if block.type != "text":
            raise APIError(400, f"{where}: {block.type} blocks are not supported here (text only)", param=where)
        parts.append(str(getattr(block, "text", "")))
    return "".join(parts)


def to_chat_request(req: MessagesRequest | CountTokensRequest, **sampling: Any) -> ChatCompletionRequest:
    """The chat request the Messages request means."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for block in m.content:
            extra = block.model_extra or {}
            if block.type == "text":
                text.append(str(extra.get("text", "")))
            elif block.type == "tool_use" and m.role == "assistant":
                calls.append({"id": extra.get("id") or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": extra.get("name", ""),
                                           "arguments": json.dumps(extra.get("input", {}))}})
            elif block.type == "tool_result" and m.role == "user":
                result = extra.get("content", "")
                if isinstance(result, list):
                    result = "".join(str(b.get("text", "")) for b in result if isinstance(b, dict))
                messages.append({"role": "tool", "tool_call_id": extra.get("tool_use_id", ""), "content": str(result)})
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning is not replayed into the prompt
            else:
                raise APIError(400, f"{where}: {block.type} blocks are not supported (text, tool_use, tool_result)",
                               param=where)
        if text or calls:
            message: dict[str, Any] = {"role": m.role, "content": "".join(text) or None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    body: dict[str, Any] = {"model": req.model, "messages": messages, **sampling}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = getattr(req, "tool_choice", None)
    if choice is not None:
        kind = choice.get("type")
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            mapped = {"type": "function", "function": {"name": choice.get("name", "")}}
        if mapped is None:
            raise APIError(400, f"tool_choice.type: {kind!r} is not auto, any, tool or none", param="tool_choice")
        body["tool_choice"] = mapped
        if choice.get("disable_parallel_tool_use"):
            body["parallel_tool_calls"] = False
    return validate_body(ChatCompletionRequest, body)


async def serve_messages(state: ServerState, request: Request) -> Response:
    try:
        req: MessagesRequest = await parse_body(request, MessagesRequest)
        sampling = {"max_tokens": req.max_tokens, "stream": False,
                    **{k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k),
                                         ("stop", req.stop_sequences)) if v is not None}}
        run = await start_chat(state, to_chat_request(req, **sampling), rid_prefix="msg")
    except APIError as err:
        return anthropic_error(err)
    except Exception as exc:  # as the guard would, in this API's shape
        return anthropic_error(as_api_error(exc))
    if req.stream:
        return StreamingResponse(message_events(state, run), media_type="text/event-stream")
    out = await run_until_done(request, final_output(run.gen))
    if out is None:
        return Response(status_code=499)
    o = out.outputs[0]
    parser, reasoning, content = parse_choice(state, run, o.text)
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [tool_use_block(c) for c in parser.calls]
    stop_reason, stop_sequence = anthropic_stop(o, bool(parser.calls))
    return JSONResponse({"id": run.rid, "type": "message", "role": "assistant", "model": state.model_name,
                         "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": message_usage(len(run.ids), len(o.token_ids), out.num_cached_tokens)})


def tool_use_block(call: Any) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def anthropic_stop(o: Any, called: bool) -> tuple[str | None, str | None]:
    if o.finish_reason is None:
        return None, None
    if o.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(o.stop_reason, str):
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def message_usage(prompt: int, output: int, cached: int) -> dict[str, int]:
    """Anthropic counts cached input apart: input_tokens are the uncached ones."""
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def message_events(state: ServerState, run: ChatRun) -> AsyncIterator[str]:
    """Anthropic's stream: message_start, per content block start / deltas / stop (thinking and
    text as they come; each tool_use whole, once its call is complete), message_delta with the
    stop_reason and usage, message_stop; an error event if the request fails."""
    yield _event("message_start", {"message": {
        "id": run.rid, "type": "message", "role": "assistant", "model": state.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": message_usage(len(run.ids), 0, 0)}})
    parser = run.choice_parser()
    index, open_kind, sent, emitted_calls = 0, None, 0, 0
    last = None
    try:
        async for out in run.gen:
            last = out
            o = out.outputs[0]
            final = o.finish_reason is not None
            reasoning, content, _ = parser.feed(o.text[sent:], final)
            sent = len(o.text)
            for kind, text in (("thinking", reasoning), ("text", content)):
                if not text:
                    continue
                if open_kind != kind:
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                        index += 1
                    block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                        else {"type": "text", "text": ""}
                    yield _event("content_block_start", {"index": index, "content_block": block})
                    open_kind = kind
                delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" \
                    else {"type": "text_delta", "text": text}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            for call in parser.calls[emitted_calls:]:
                if open_kind is not None:
                    yield _event("content_block_stop", {"index": index})
                    index += 1
                    open_kind = None
                block = tool_use_block(call)
                yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                yield _event("content_block_stop", {"index": index})
                index += 1
                emitted_calls += 1
    except Exception as exc:
        err = as_api_error(exc)
        yield _event("error", {"error": {"type": "api_error" if err.status >= 500 else "invalid_request_error",
                                         "message": err.message}})
        return
    if open_kind is not None:
        yield _event("content_block_stop", {"index": index})
    o = last.outputs[0] if last is not None else None
    stop_reason, stop_sequence = anthropic_stop(o, bool(parser.calls)) if o is not None else ("end_turn", None)
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": {"output_tokens": len(o.token_ids) if o is not None else 0}})
    yield _event("message_stop", {})


async def serve_count_tokens(state: ServerState, request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's tokens as the chat template renders it."""
    try:
        req: CountTokensRequest = await parse_body(request, CountTokensRequest)
        check_model(state, req.model)
        chat = to_chat_request(req, max_tokens=1)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
        ids, _ = await chat_prompt_ids(state.prompt_pool, state.core, chat, tools)
    except APIError as err:
        return anthropic_error(err)
    return JSONResponse({"input_tokens": len(ids)})

