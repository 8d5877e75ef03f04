"""POST /v1/completions: one engine request per prompt, echo and logprobs, one JSON or an SSE
stream that interleaves the prompts' choices."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from anna.core.outputs import RequestOutput
from anna.server.common import (ServerState, as_api_error, build_sampling_params, check_model, final_output,
                                finish_reason, parse_body, run_until_done, sse, start_request, stream_usage, usage)
from anna.server.constraints import compile_constraint, request_constraint
from anna.server.logprobs import completion_logprobs, echoed_logprobs, vllm_prompt_logprobs
from anna.server.protocol import APIError, CompletionRequest


async def serve_completions(state: ServerState, request: Request) -> Response:
    """POST /v1/completions."""
    req: CompletionRequest = await parse_body(request, CompletionRequest)
    check_model(state, req.model)
    if req.suffix:
        raise APIError(400, "suffix: not supported (Anna completes after the prompt only)", param="suffix")
    if req.best_of not in (None, 1, req.n):
        raise APIError(400, f"best_of: {req.best_of} is not supported: Anna returns every sample it draws, so "
                            f"best_of may only be 1 or n ({req.n})", param="best_of")
    # max_tokens 0 (with echo, the older loglikelihood shape of evaluation harnesses): the prompt is
    # computed (and its logprobs returned), nothing generated; the one token the engine samples is dropped
    scoring = req.max_tokens == 0
    if scoring and req.stream:
        raise APIError(400, "max_tokens: 0 (the prompt scored, nothing generated) is answered without streaming",
                       param="max_tokens")
    engine = state.core
    prompts = normalize_prompts(req.prompt)
    encoded = []
    for p in prompts:
        try:
            text, ids = await state.prompt_pool.run(engine.inputs.encode_prompt, p, req.truncate_prompt_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        encoded.append((text, ids))
    top = req.logprobs
    spec, spec_field = request_constraint(req)
    prompt_top = req.prompt_logprobs if req.prompt_logprobs is not None else top if req.echo else None
    all_params = [build_sampling_params(state, req, len(ids), 1 if scoring else req.max_tokens, top, spec, prompt_top)
                  for _, ids in encoded]
    await compile_constraint(state.prompt_pool, engine, spec, spec_field)
    rid = f"cmpl-{uuid.uuid4().hex}"
    gens = [await start_request(state, f"{rid}-{i}", ids, p) for i, ((_, ids), p) in enumerate(zip(encoded, all_params))]
    base = {"id": rid, "created": int(time.time()), "model": state.model_name}
    n = req.n
    if req.stream:
        return StreamingResponse(completion_stream(state, gens, encoded, base, n, req.echo,
                                                   req.prompt_logprobs is not None, top or 0, prompt_top or 0,
                                                   *stream_usage(req.stream_options)),
                                 media_type="text/event-stream")
    outs = await run_until_done(request, asyncio.gather(*(final_output(g) for g in gens)))
    if outs is None:
        return Response(status_code=499)
    choices = []
    prompt_tokens = completion_tokens = cached = 0
    for i, (out, (text, ids)) in enumerate(zip(outs, encoded)):
        prefix = (text if text is not None else engine.tokenizer.decode(ids)) if req.echo else ""
        prompt_tokens += len(ids)
        cached += out.num_cached_tokens
        for o in out.outputs:
            generated = 0 if scoring else len(o.token_ids)
            completion_tokens += generated
            lp = completion_logprobs(engine, o, 0, generated, len(prefix), top or 0)
            choices.append({"index": i * n + o.index, "text": prefix + ("" if scoring else o.text),
                            "logprobs": echoed_logprobs(engine, out, lp, prompt_top or 0) if req.echo else lp,
                            "finish_reason": "length" if scoring else finish_reason(o, None),
                            "stop_reason": None if scoring else o.stop_reason})
            if req.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(out)
    return JSONResponse({**base, "object": "text_completion", "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens, cached)})


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    raise APIError(400, "prompt: must be a string, a list of strings, or token ids", param="prompt")


async def completion_stream(state: ServerState, gens: list[AsyncIterator[RequestOutput]],
                            encoded: list[tuple[str | None, list[int]]], base: dict[str, Any], n: int, echo: bool,
                            send_prompt_logprobs: bool, top: int, prompt_top: int, include_usage: bool,
                            continuous_usage: bool) -> AsyncIterator[str]:
    engine = state.core
    chunk = {**base, "object": "text_completion"}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    echoed: dict[tuple[int, int], str] = {}  # the prompt text each choice echoed
    finals: dict[int, RequestOutput] = {}
    running = len(gens)
    try:
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, Exception):
                yield sse(as_api_error(item).body())
                yield "data: [DONE]\n\n"
                return
            finals[i] = item
            for o in item.outputs:
                key = (i, o.index)
                first = key not in sent_text
                prefix = ""
                if first:
                    sent_text[key] = 0
                    if echo:
                        text, ids = encoded[i]
                        prefix = echoed[key] = text if text is not None else engine.tokenizer.decode(ids)
                start = sent_text[key]
                delta = prefix + o.text[start:]
                sent_text[key] = len(o.text)
                lp = completion_logprobs(engine, o, sent_tokens.get(key, 0), len(o.token_ids),
                                         start + len(echoed.get(key, "")), top)
                if first and echo:
                    lp = echoed_logprobs(engine, item, lp, prompt_top)
                sent_tokens[key] = len(o.token_ids)
                if delta or o.finish_reason is not None or lp:
                    choice = {"index": i * n + o.index, "text": delta, "logprobs": lp,
                              "finish_reason": finish_reason(o, None)}
                    if first and send_prompt_logprobs:
                        choice["prompt_logprobs"] = vllm_prompt_logprobs(item)
                    data = {**chunk, "choices": [choice]}
                    if continuous_usage:  # this choice's prompt and tokens so far
                        data["usage"] = usage(len(encoded[i][1]), len(o.token_ids), item.num_cached_tokens)
                    yield sse(data)
    finally:
        for t in tasks:
            t.cancel()
    if include_usage:
        prompt_tokens = sum(len(ids) for _, ids in encoded)
        completion = sum(len(o.token_ids) for out in finals.values() for o in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals.values())
        yield sse({**chunk, "choices": [], "usage": usage(prompt_tokens, completion, cached)})
    yield "data: [DONE]\n\n"
