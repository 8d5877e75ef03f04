"""POST /v1/responses, OpenAI's Responses API, on the same path as chat: ``instructions`` and the
input items (messages with input_text parts, function_call and function_call_output items), after
those of the response ``previous_response_id`` names, become a chat request, with the tools (flat
function definitions), tool_choice, ``text.format`` (json_schema / json_object) and sampling
fields; the answer is output items (reasoning, a message with output_text, function calls), whole
or as the Responses event stream. Responses are kept (unless ``store`` is false) in a bounded
in-memory store (response_store.py), which GET and DELETE /v1/responses/{id} read."""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from anna.server.common import ServerState, as_api_error, final_output, parse_body, run_until_done, \
    sse, validate_body
from anna.server.protocol import APIError, ChatCompletionRequest
from anna.server.response_store import StoredResponse
from anna.server.serving_chat import ChatRun, parse_choice, start_chat


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None


def _part_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}.{j}: {kind!r} parts are not supported (text only)", param=f"{where}.{j}")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def request_items(state: ServerState, req: ResponsesRequest) -> tuple[list[dict[str, Any]], int]:
    """The conversation this request continues (the items of the response previous_response_id
    names) followed by its own input items; and how many of them came before its own."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = state.responses.get(req.previous_response_id)
        if stored is None:
            kept = (f"the newest {state.responses.capacity} responses are kept (--responses-store-size)"
                    if state.responses.capacity else "responses are not kept (--responses-store-size 0)")
            raise APIError(404, f"previous_response_id: no response {req.previous_response_id!r} is stored; {kept}",
                           param="previous_response_id", code="previous_response_not_found")
        history = stored.conversation
    own = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    return history + own, len(history)


def to_chat_request(req: ResponsesRequest, items: list[dict[str, Any]], first_own: int = 0) -> ChatCompletionRequest:
    """``items``: the whole conversation, of which those from ``first_own`` on are the request's
    input (what errors name)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i - first_own}" if i >= first_own else f"previous_response_id (item {i})"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: {role!r} is not user, assistant, system or developer", param=where)
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _part_text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": str(item.get("output", ""))})
        elif kind == "reasoning":
            continue  # earlier reasoning is not replayed into the prompt
        else:
            raise APIError(400, f"{where}.type: {kind!r} items are not supported (message, function_call, "
                                "function_call_output)", param=where)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": False,
                            "parallel_tool_calls": req.parallel_tool_calls}
    for ours, theirs in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                         ("top_p", req.top_p)):
        if theirs is not None:
            body[ours] = theirs
    if req.tools:
        tools = []
        for j, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"tools.{j}.type: only function tools are served (got {tool.get('type')!r})",
                               param=f"tools.{j}")
            tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                           if k in tool}})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name", "")}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = (req.text or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    return validate_body(ChatCompletionRequest, body)


async def serve_responses(state: ServerState, request: Request) -> Response:
    """POST /v1/responses."""
    req: ResponsesRequest = await parse_body(request, ResponsesRequest)
    items, first_own = request_items(state, req)
    run = await start_chat(state, to_chat_request(req, items, first_own), rid_prefix="resp")
    shell = {"id": run.rid, "object": "response", "created_at": int(time.time()), "model": state.model_name,
             "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": req.tool_choice or "auto",
             "tools": req.tools or [], "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
             "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
             "previous_response_id": req.previous_response_id, "store": req.store is not False}

    def keep(response: dict[str, Any]) -> None:
        if req.store is not False:
            state.responses.put(StoredResponse(response, items))

    if req.stream:
        return StreamingResponse(response_events(run, shell, keep), media_type="text/event-stream")
    out = await run_until_done(request, final_output(run.gen))
    if out is None:
        return Response(status_code=499)
    o = out.outputs[0]
    parser, reasoning, content = parse_choice(state, run, o.text)
    output = _output_items(run.rid, reasoning, content, parser.calls)
    response = {**shell, **_ending(o), "output": output,
                "usage": _usage(len(run.ids), len(o.token_ids), out.num_cached_tokens)}
    keep(response)
    return JSONResponse(response)


def _stored(state: ServerState, response_id: str) -> StoredResponse:
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"response_id: no response {response_id!r} is stored", param="response_id",
                       code="not_found")
    return stored


def serve_stored_response(state: ServerState, response_id: str, delete: bool = False) -> Response:
    """GET /v1/responses/{id} (the response as it was returned) and DELETE (forget it)."""
    stored = _stored(state, response_id)
    if delete:
        state.responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    return JSONResponse(stored.response)


def serve_input_items(state: ServerState, response_id: str) -> Response:
    """GET /v1/responses/{id}/input_items: the conversation that response answered, newest first
    as OpenAI lists them."""
    stored = _stored(state, response_id)
    data = [_as_item(item, i) for i, item in enumerate(stored.input_items)][::-1]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": False})


def _as_item(item: dict[str, Any], index: int) -> dict[str, Any]:
    """An input item as the API lists it: with a type and an id."""
    out = {"type": "message", **item}
    out.setdefault("id", f"item_{index}")
    if out["type"] == "message" and isinstance(out.get("content"), str):
        out["content"] = [{"type": "input_text", "text": out["content"]}]
    return out


def _output_items(rid: str, reasoning: str, content: str, calls: list) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": reasoning}]})
    if content or not calls:
        items.append(_message_item(rid, content))
    items += [_call_item(c) for c in calls]
    return items


def _message_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: Any) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _ending(o: Any) -> dict[str, Any]:
    if o.finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed", "incomplete_details": None}


def _usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}


async def response_events(run: ChatRun, shell: dict[str, Any],
                          keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    """The Responses stream: response.created, the message's output_text deltas as they come,
    each function call whole once complete, response.completed (or incomplete) with the output
    and usage, which ``keep`` stores; response.failed if the request fails."""
    seq = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **data})

    yield event("response.created", response={**shell, "status": "in_progress", "output": []})
    parser = run.choice_parser()
    text, reasoning_text, sent, message_open, last = "", "", 0, False, None
    message_index = 0
    try:
        async for out in run.gen:
            last = out
            o = out.outputs[0]
            reasoning, content, _ = parser.feed(o.text[sent:], o.finish_reason is not None)
            sent = len(o.text)
            reasoning_text += reasoning
            if content:
                if not message_open:
                    message_index = 1 if reasoning_text else 0
                    yield event("response.output_item.added", output_index=message_index,
                                item={**_message_item(run.rid, "", "in_progress"), "content": []})
                    yield event("response.content_part.added", item_id=f"msg_{run.rid}", output_index=message_index,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    message_open = True
                text += content
                yield event("response.output_text.delta", item_id=f"msg_{run.rid}", output_index=message_index,
                            content_index=0, delta=content)
    except Exception as exc:
        err = as_api_error(exc)
        yield event("response.failed", response={**shell, "status": "failed", "output": [],
                                                  "error": {"code": err.code or err.type, "message": err.message}})
        return
    o = last.outputs[0]
    output = _output_items(run.rid, reasoning_text, text, parser.calls)
    if message_open:
        yield event("response.output_text.done", item_id=f"msg_{run.rid}", output_index=message_index,
                    content_index=0, text=text)
        yield event("response.content_part.done", item_id=f"msg_{run.rid}", output_index=message_index,
                    content_index=0, part={"type": "output_text", "text": text, "annotations": []})
        yield event("response.output_item.done", output_index=message_index, item=_message_item(run.rid, text))
    for index, item in enumerate(output):
        if item["type"] == "function_call":
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
    ending = _ending(o)
    final = {**shell, **ending, "output": output, "usage": _usage(len(run.ids), len(o.token_ids), last.num_cached_tokens)}
    keep(final)
    yield event("response.completed" if ending["status"] == "completed" else "response.incomplete", response=final)

