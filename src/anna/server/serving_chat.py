"""POST /v1/chat/completions: messages -> the chat template -> tokens, one engine request, and
the response as one JSON or an SSE stream (reasoning and tool calls split out per choice)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from anna.core.outputs import RequestOutput
from anna.runtime.engine import LLMEngine
from anna.server.chat import render_chat_request
from anna.server.common import (ChoiceParser, ServerState, as_api_error, build_sampling_params, check_model,
                                final_output, finish_reason, parse_body, run_until_done, sse, start_request,
                                stream_usage, usage)
from anna.core.sampling_params import StructuredOutputsParams
from anna.server.constraints import after_reasoning, compile_constraint, request_constraint
from anna.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from anna.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice
from anna.server.reasoning import prompt_reasoning
from anna.server.text_pool import TextPool
from anna.server.tool_parsers import TOOL_PARSERS, ToolParser, forced_call_parser


async def chat_prompt_ids(pool: TextPool, engine: LLMEngine, req: Any, tools: list[dict[str, Any]] | None,
                          truncate_prompt_tokens: int | None = None) -> tuple[list[int], str]:
    """The chat template rendered and tokenized off the event loop (a long conversation would
    otherwise pause every stream for as long as it takes), and what the rendered prompt leaves of
    a reasoning block (reasoning.prompt_reasoning)."""
    def work() -> tuple[list[int], str]:
        text = render_chat_request(engine.tokenizer, req, tools)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        ids = engine.inputs.encode_prompt(ids, truncate_prompt_tokens)[1] if truncate_prompt_tokens else ids
        return ids, prompt_reasoning(text)
    return await pool.run(work)


@dataclass
class ChatRun:
    """A chat request checked and started: what its response needs."""

    gen: AsyncIterator[RequestOutput]
    rid: str
    ids: list[int]  # the prompt's tokens
    tools: list[dict[str, Any]] | None  # the tools calls are parsed against (None: no tool calls)
    tool_parser: type[ToolParser] | None  # the format calls are read in (None: no tool calls)
    reasoning_parser: str  # the --reasoning-parser in effect
    forced: bool  # tool_choice required or a named function: the output is calls
    prompt_reasoning: str  # what the rendered prompt leaves of a reasoning block
    params: Any  # SamplingParams
    top: int | None  # logprobs: alternatives per token, or None

    def choice_parser(self, stream: bool = False) -> ChoiceParser:
        """A parser for one of this request's choices."""
        return ChoiceParser(self.tool_parser, self.tools, self.reasoning_parser, stream, self.prompt_reasoning,
                            self.forced)


async def start_chat(state: ServerState, req: ChatCompletionRequest, rid_prefix: str = "chatcmpl") -> ChatRun:
    """Check a chat request (tools and tool_choice, constraints, lengths), render and tokenize
    its prompt, and hand it to the engine; the shared path of /v1/chat/completions and the other
    chat-shaped APIs."""
    check_model(state, req.model)
    engine = state.core
    parsers = engine.settings  # with the parsers that auto chose from the chat template
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice: function {name!r} is not among the tools", param="tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise APIError(400, f"tool_choice: {choice!r} is not none, auto, required or a function",
                       param="tool_choice")
    elif choice == "required" and not tools:
        raise APIError(400, "tool_choice: 'required' needs tools", param="tool_choice")
    if choice == "none":
        tools = None
    tool_parser = TOOL_PARSERS.get(parsers.tool_call_parser) if tools else None
    forced = isinstance(choice, NamedToolChoice) or choice == "required"
    if forced:
        forced = tools if choice == "required" else [t for t in tools if t["function"]["name"] == name]
        tool_parser, grammar = forced_call_parser(parsers.tool_call_parser, forced,
                                                  req.parallel_tool_calls and choice == "required")
        spec, spec_field = StructuredOutputsParams(grammar=grammar), "tool_choice"
    else:
        spec, spec_field = request_constraint(req)
    if tool_parser is not None and tool_parser.KEEPS_SPECIAL_TOKENS:  # its markers are special tokens
        req = req.model_copy(update={"skip_special_tokens": False})
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
    ids, reasoning = await chat_prompt_ids(state.prompt_pool, engine, req, tools, req.truncate_prompt_tokens)
    if spec is not None and parsers.reasoning_parser != "none":
        spec = after_reasoning(spec, reasoning)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(state, req, len(ids), req.max_completion_tokens or req.max_tokens, top, spec,
                                   req.prompt_logprobs)
    await compile_constraint(state.prompt_pool, engine, spec, spec_field)
    rid = f"{rid_prefix}-{uuid.uuid4().hex}"
    gen = await start_request(state, rid, ids, params)
    return ChatRun(gen, rid, ids, tools, tool_parser, parsers.reasoning_parser, forced, reasoning, params, top)


def parse_choice(state: ServerState, run: ChatRun, text: str) -> tuple[ChoiceParser, str, str]:
    """A finished choice's text split into (its parser, which holds the tool calls), reasoning and
    content: what every chat-shaped API answers from."""
    parser = run.choice_parser()
    reasoning, content, _ = parser.feed(text, final=True)
    return parser, reasoning, content


async def serve_chat(state: ServerState, request: Request) -> Response:
    """POST /v1/chat/completions."""
    req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
    run = await start_chat(state, req)
    base = {"id": run.rid, "created": int(time.time()), "model": state.model_name}
    if req.stream:
        return StreamingResponse(chat_stream(run, base, *stream_usage(req.stream_options)),
                                 media_type="text/event-stream")
    out = await run_until_done(request, final_output(run.gen))
    if out is None:
        return Response(status_code=499)
    choices = []
    for o in out.outputs:
        parser, reasoning, content = parse_choice(state, run, o.text)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not parser.calls else None}
        if parser.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if parser.calls:
            message["tool_calls"] = [c.to_openai() for c in parser.calls]
        choices.append({"index": o.index, "message": message, "finish_reason": finish_reason(o, parser),
                        "logprobs": chat_logprobs(o, 0, len(o.token_ids), run.top or 0),
                        "stop_reason": o.stop_reason})
        if req.prompt_logprobs is not None:
            choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(out)
    completion = sum(len(o.token_ids) for o in out.outputs)
    return JSONResponse({**base, "object": "chat.completion", "choices": choices,
                         "usage": usage(len(run.ids), completion, out.num_cached_tokens)})


async def chat_stream(run: ChatRun, base: dict[str, Any], include_usage: bool,
                      continuous_usage: bool) -> AsyncIterator[str]:
    gen, n, num_prompt, top = run.gen, run.params.n, len(run.ids), run.top or 0
    chunk = {**base, "object": "chat.completion.chunk"}
    sent_tokens = [0] * n

    def emit(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        data = {**chunk, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if continuous_usage:  # this choice's tokens so far
            data["usage"] = usage(num_prompt, sent_tokens[index], last.num_cached_tokens if last else 0)
        return sse(data)

    parsers = [run.choice_parser(stream=True) for _ in range(n)]
    sent_text = [0] * n
    done = [False] * n
    last: RequestOutput | None = None
    for i in range(n):
        yield emit(i, {"role": "assistant", "content": ""})
    try:
        async for out in gen:
            last = out
            for o in out.outputs:
                i = o.index
                if done[i]:
                    continue
                final = o.finish_reason is not None
                delta_text = o.text[sent_text[i]:]
                sent_text[i] = len(o.text)
                reasoning, content, calls = parsers[i].feed(delta_text, final)
                logprobs = chat_logprobs(o, sent_tokens[i], len(o.token_ids), top)
                sent_tokens[i] = len(o.token_ids)
                delta: dict[str, Any] = {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = calls
                if delta or logprobs:
                    yield emit(i, delta, logprobs=logprobs)
                if final:
                    done[i] = True
                    yield emit(i, {}, finish_reason(o, parsers[i]))
    except Exception as exc:  # the stream has started: report in-band, as OpenAI does
        yield sse(as_api_error(exc).body())
        yield "data: [DONE]\n\n"
        return
    if include_usage and last is not None:
        completion = sum(len(o.token_ids) for o in last.outputs)
        yield sse({**chunk, "choices": [], "usage": usage(num_prompt, completion, last.num_cached_tokens)})
    yield "data: [DONE]\n\n"
