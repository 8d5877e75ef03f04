"""The OpenAI-compatible HTTP server: routes, validation, streaming, disconnect handling."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from anna.core.config import ResolvedSettings
from anna.core.errors import EngineDeadError, RequestError
from anna.core.outputs import CompletionOutput, RequestOutput
from anna.core.sampling_params import SamplingParams, StructuredOutputsParams
from anna.runtime.engine import LLMEngine
from anna.runtime.warmup import run_warmup
from anna.server.async_engine import AsyncEngine
from anna.server.chat import render_chat_request
from anna.server.constraints import after_reasoning, compile_constraint, forced_tool_constraint, request_constraint
from anna.server.guard import RequestGuard
from anna.server.json_body import parse_json_body
from anna.server.openapi import document_request_bodies
from anna.server.logprobs import chat_logprobs, completion_logprobs, echoed_logprobs, vllm_prompt_logprobs
from anna.server.metrics import EngineCollector, make_registry, render
from anna.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  NamedToolChoice, SamplingFields, StreamOptions, TokenizeRequest, error_response)
from anna.server.reasoning import REASONING_PARSERS
from anna.server.text_pool import TextPool
from anna.server.tool_parsers import TOOL_PARSERS, ParsedToolCall, ToolCallStreamer

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    settings: ResolvedSettings
    engine: AsyncEngine | None = None
    load_error: BaseException | None = None
    on_load_error: Callable[[], None] | None = None  # `anna serve` stops the server: it refuses to start
    # `anna serve` stops the server (exit code 1) when the engine cannot go on: a supervisor restarts it
    on_engine_dead: Callable[[BaseException], None] | None = None
    model_names: list[str] = field(default_factory=list)  # what requests may name; responses report the first
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # shutting down: requests in flight finish, new ones get 503
    prompt_pool: TextPool = field(init=False)  # chat templates, prompt tokenization, grammars of generation requests
    tokenize_pool: TextPool = field(init=False)  # /tokenize and /detokenize

    def __post_init__(self) -> None:
        s = self.settings
        self.prompt_pool = TextPool("prompt", s.prompt_workers, s.text_queue_limit)
        self.tokenize_pool = TextPool("tokenize", s.tokenize_workers, s.text_queue_limit)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def core(self) -> LLMEngine:
        if self.engine is None:
            raise APIError(503, "the model is still loading" if self.load_error is None
                           else f"the model failed to load: {self.load_error}")
        return self.engine.engine


def served_names(settings: ResolvedSettings) -> list[str]:
    names = [n.strip() for n in (settings.served_model_name or "").split(",") if n.strip()]
    return names or [settings.model or "anna-demo"]


# ---------------------------------------------------------------- request helpers

async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    body = parse_json_body(await request.body())
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in state.model_names:
        served = ", ".join(f"'{n}'" for n in state.model_names)
        raise APIError(404, f"The model '{name}' does not exist; this server serves {served}",
                       param="model", code="model_not_found")


SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def build_sampling_params(state: ServerState, req: SamplingFields, num_prompt_tokens: int,
                          max_tokens: int | None, logprobs: int | None,
                          structured: StructuredOutputsParams | None = None,
                          prompt_logprobs: int | None = None) -> SamplingParams:
    s = state.settings
    if req.n > s.max_n:
        raise APIError(400, f"n: at most {s.max_n} samples per request (got {req.n})", param="n")
    try:
        logit_bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
    defaults = state.core.sampling_defaults  # the model's generation_config, for the fields a request leaves out
    cap = defaults.get("max_tokens")  # max_new_tokens: a limit for every request, as in vLLM
    if cap is not None:
        room = max(state.core.max_model_len - num_prompt_tokens, 1)
        max_tokens = min(cap, room) if max_tokens is None else min(max_tokens, cap)

    def pick(name: str) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, SAMPLING_DEFAULTS[name])

    try:
        params = SamplingParams(
            n=req.n, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"),
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"), seed=req.seed, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, max_tokens=max_tokens,
            min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logit_bias=logit_bias or None,
            allowed_token_ids=req.allowed_token_ids, truncate_prompt_tokens=req.truncate_prompt_tokens,
            bad_words=req.bad_words,
            structured_outputs=structured, output_kind="cumulative" if req.stream else "final_only")
        state.core.check_request(num_prompt_tokens, params)
    except ValueError as exc:
        raise invalid_request(exc) from None
    return params


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_done(request: Request, work: Any) -> Any:
    """Await ``work`` unless the client goes away first; then cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return None
    return task.result()


async def chat_prompt_ids(pool: TextPool, engine: LLMEngine, req: Any, tools: list[dict[str, Any]] | None,
                          truncate_prompt_tokens: int | None = None) -> list[int]:
    """The chat template rendered and tokenized off the event loop: a long conversation would
    otherwise pause every stream for as long as it takes."""
    def work() -> list[int]:
        ids = engine.tokenizer.encode(render_chat_request(engine.tokenizer, req, tools), add_special_tokens=False)
        return engine.encode_prompt(ids, truncate_prompt_tokens)[1] if truncate_prompt_tokens else ids
    return await pool.run(work)


async def final_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    try:
        async for out in gen:
            last = out
    except Exception as exc:
        raise as_api_error(exc) from None
    return last


def invalid_request(exc: ValueError) -> APIError:
    return APIError(400, str(exc), param=str(exc).split(":", 1)[0])


def as_api_error(exc: BaseException) -> APIError:
    """How an error of the engine's reaches an HTTP client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return APIError(exc.status, exc.message, param=exc.param)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    if isinstance(exc, ValueError):  # the engine refused the request (its errors start with the field's name)
        return invalid_request(exc)
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def stream_usage(options: StreamOptions | None) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage in every chunk): vLLM's continuous_usage_stats takes effect
    only with include_usage."""
    final = bool(options and options.include_usage)
    return final, final and options.continuous_usage_stats


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


# ---------------------------------------------------------------- chat output parsing

class ChoiceParser:
    """Splits one choice's text into reasoning, content and tool calls, whole or incrementally."""

    def __init__(self, state: ServerState, parse_tools: bool, stream: bool = False) -> None:
        s = state.settings
        self.reasoning = REASONING_PARSERS[s.reasoning_parser]() if s.reasoning_parser != "none" else None
        self.tools = TOOL_PARSERS[s.tool_call_parser]() if parse_tools and s.tool_call_parser != "none" else None
        self.streamer = ToolCallStreamer(self.tools) if stream and self.tools is not None else None

    @property
    def calls(self) -> list[ParsedToolCall]:
        """The complete tool calls so far."""
        return self.tools.calls if self.tools is not None else []

    def feed(self, delta: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, tool call stream deltas); the deltas are empty unless streaming."""
        reasoning, content = "", delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta)
            if final:
                r2, c2 = self.reasoning.finish()
                reasoning, content = reasoning + r2, content + c2
        deltas: list[dict[str, Any]] = []
        if self.streamer is not None:
            content, deltas = self.streamer.feed(content, final)
        elif self.tools is not None:
            content, _ = self.tools.feed(content)
            if final:
                content += self.tools.finish()[0]
        return reasoning, content, deltas


def finish_reason(out: CompletionOutput, parser: ChoiceParser | None) -> str | None:
    if out.finish_reason is None:
        return None
    if parser is not None and parser.calls and out.finish_reason == "stop":
        return "tool_calls"
    if out.finish_reason == "abort":
        return "stop"
    return out.finish_reason


# ---------------------------------------------------------------- app

def create_app(settings: ResolvedSettings, *, load_in_background: bool = True) -> FastAPI:
    state = ServerState(settings=settings, model_names=served_names(settings))
    registry = make_registry(EngineCollector(lambda: state.engine.engine if state.engine else None,
                                             state.model_name))

    def engine_dead(exc: BaseException) -> None:
        if state.on_engine_dead is not None:
            state.on_engine_dead(exc)

    def load() -> None:
        try:
            engine = LLMEngine(settings)
            if settings.inference_warmup:
                run_warmup(engine)
            else:
                log.warning("Inference warmup is off (--no-inference-warmup): the first requests pay first-use costs")
            state.engine = AsyncEngine(engine, on_dead=engine_dead)
            log.info("Ready: serving %s on http://%s:%d", ", ".join(map(repr, state.model_names)), settings.host,
                     settings.port)
        except BaseException as exc:  # reported by /health and every route
            if isinstance(exc, ValueError):  # a setting or model file that does not work: the message says which
                log.error("model failed to load: %s", exc)
            else:
                log.exception("model failed to load")
            state.load_error = exc
            if state.on_load_error is not None:
                state.on_load_error()

    async def lifespan(app: FastAPI):
        if load_in_background:
            threading.Thread(target=load, name="anna-load", daemon=True).start()
        else:
            load()
        yield
        if state.engine is not None:
            state.engine.shutdown()
        state.prompt_pool.shutdown()
        state.tokenize_pool.shutdown()

    app = FastAPI(title="Anna", lifespan=lifespan)
    app.state.anna = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        """Unknown routes and methods answer in OpenAI's error shape too, not FastAPI's {"detail": ...}."""
        return error_response(APIError(exc.status_code, str(exc.detail)), headers=exc.headers)

    @app.exception_handler(RequestError)
    @app.exception_handler(EngineDeadError)
    async def engine_error(_: Request, exc: Exception) -> Response:
        return error_response(as_api_error(exc))

    app.add_middleware(RequestGuard, settings=settings, draining=lambda: state.draining)
    origins = [o.strip() for o in settings.allowed_origins.split(",") if o.strip()]
    if origins:  # added last, so outermost: browsers' preflight requests carry no API key
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.engine is not None and state.engine.error is None:
            return JSONResponse({"status": "ok"})
        detail = "loading" if state.load_error is None and state.engine is None else "error"
        return JSONResponse({"status": detail}, status_code=503)

    @app.get("/version")
    async def version() -> JSONResponse:
        from anna import __version__

        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        engine = state.core
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": state.created, "owned_by": "anna",
            "root": engine.model_dir, "max_model_len": engine.max_model_len} for name in state.model_names]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/profile")
    async def debug_profile() -> JSONResponse:
        profiler = state.core.profiler
        if profiler is None:
            raise APIError(404, "runtime profiling is off: start the server with --profile-runtime")
        return JSONResponse(profiler.report())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, TokenizeRequest)
        check_model(state, req.model)
        engine = state.core
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await chat_prompt_ids(state.tokenize_pool, engine, req, tools)
        elif req.prompt is not None:
            ids = await state.tokenize_pool.run(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "prompt: give 'prompt' or 'messages'", param="prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest)
        check_model(state, req.model)
        engine = state.core
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens: ids must be in 0..{vocab - 1}", param="tokens")
        text = await state.tokenize_pool.run(engine.tokenizer.decode, req.tokens, False)
        return JSONResponse({"prompt": text})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        check_model(state, req.model)
        engine = state.core
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
        if isinstance(choice, NamedToolChoice) or choice == "required":
            forced = tools if choice == "required" else [t for t in tools if t["function"]["name"] == name]
            spec, spec_field = forced_tool_constraint(forced, req.parallel_tool_calls and choice == "required",
                                                      state.settings.tool_call_parser)
        else:
            spec, spec_field = request_constraint(req)
        if spec is not None and state.settings.reasoning_parser != "none":
            spec = after_reasoning(spec)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        ids = await chat_prompt_ids(state.prompt_pool, engine, req, tools, req.truncate_prompt_tokens)
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = build_sampling_params(state, req, len(ids), req.max_completion_tokens or req.max_tokens, top, spec,
                                       req.prompt_logprobs)
        await compile_constraint(state.prompt_pool, engine, spec, spec_field)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        parse_tools = tools is not None
        gen = state.engine.generate(rid, ids, params)
        base = {"id": rid, "created": int(time.time()), "model": state.model_name}
        if req.stream:
            return StreamingResponse(chat_stream(state, gen, base, params.n, len(ids), parse_tools,
                                                 *stream_usage(req.stream_options)),
                                     media_type="text/event-stream")
        out = await run_until_done(request, final_output(gen))
        if out is None:
            return Response(status_code=499)
        choices = []
        for o in out.outputs:
            parser = ChoiceParser(state, parse_tools)
            reasoning, content, _ = parser.feed(o.text, final=True)
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not parser.calls else None}
            if parser.reasoning is not None:
                message["reasoning_content"] = reasoning or None
            if parser.calls:
                message["tool_calls"] = [c.to_openai() for c in parser.calls]
            choices.append({"index": o.index, "message": message, "finish_reason": finish_reason(o, parser),
                            "logprobs": chat_logprobs(engine, o, 0, len(o.token_ids)),
                            "stop_reason": o.stop_reason})
            if req.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(engine, out)
        completion = sum(len(o.token_ids) for o in out.outputs)
        return JSONResponse({**base, "object": "chat.completion", "choices": choices,
                             "usage": usage(len(ids), completion, out.num_cached_tokens)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        check_model(state, req.model)
        if req.suffix:
            raise APIError(400, "suffix: not supported (Anna completes after the prompt only)", param="suffix")
        if req.best_of not in (None, 1, req.n):
            raise APIError(400, f"best_of: {req.best_of} is not supported: Anna returns every sample it draws, so "
                                f"best_of may only be 1 or n ({req.n})", param="best_of")
        engine = state.core
        prompts = normalize_prompts(req.prompt)
        encoded = []
        for p in prompts:
            try:
                text, ids = await state.prompt_pool.run(engine.encode_prompt, p, req.truncate_prompt_tokens)
            except ValueError as exc:
                raise APIError(400, str(exc), param="prompt") from None
            encoded.append((text, ids))
        top = req.logprobs
        spec, spec_field = request_constraint(req)
        prompt_top = req.prompt_logprobs if req.prompt_logprobs is not None else top if req.echo else None
        all_params = [build_sampling_params(state, req, len(ids), req.max_tokens, top, spec, prompt_top)
                      for _, ids in encoded]
        await compile_constraint(state.prompt_pool, engine, spec, spec_field)
        rid = f"cmpl-{uuid.uuid4().hex}"
        gens = [state.engine.generate(f"{rid}-{i}", ids, p) for i, ((_, ids), p) in enumerate(zip(encoded, all_params))]
        base = {"id": rid, "created": int(time.time()), "model": state.model_name}
        n = req.n
        if req.stream:
            return StreamingResponse(completion_stream(state, gens, encoded, base, n, req.echo,
                                                       req.prompt_logprobs is not None,
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
                completion_tokens += len(o.token_ids)
                lp = completion_logprobs(engine, o, 0, len(o.token_ids), len(prefix))
                choices.append({"index": i * n + o.index, "text": prefix + o.text,
                                "logprobs": echoed_logprobs(engine, out, lp) if req.echo else lp,
                                "finish_reason": finish_reason(o, None), "stop_reason": o.stop_reason})
                if req.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(engine, out)
        return JSONResponse({**base, "object": "text_completion", "choices": choices,
                             "usage": usage(prompt_tokens, completion_tokens, cached)})

    document_request_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
    return app


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


async def chat_stream(state: ServerState, gen: AsyncIterator[RequestOutput], base: dict[str, Any], n: int,
                      num_prompt: int, parse_tools: bool, include_usage: bool,
                      continuous_usage: bool) -> AsyncIterator[str]:
    engine = state.core
    chunk = {**base, "object": "chat.completion.chunk"}
    sent_tokens = [0] * n

    def emit(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        data = {**chunk, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if continuous_usage:  # this choice's tokens so far
            data["usage"] = usage(num_prompt, sent_tokens[index], last.num_cached_tokens if last else 0)
        return sse(data)

    parsers = [ChoiceParser(state, parse_tools, stream=True) for _ in range(n)]
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
                logprobs = chat_logprobs(engine, o, sent_tokens[i], len(o.token_ids))
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


async def completion_stream(state: ServerState, gens: list[AsyncIterator[RequestOutput]],
                            encoded: list[tuple[str | None, list[int]]], base: dict[str, Any], n: int, echo: bool,
                            send_prompt_logprobs: bool, include_usage: bool,
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
                                         start + len(echoed.get(key, "")))
                if first and echo:
                    lp = echoed_logprobs(engine, item, lp)
                sent_tokens[key] = len(o.token_ids)
                if delta or o.finish_reason is not None or lp:
                    choice = {"index": i * n + o.index, "text": delta, "logprobs": lp,
                              "finish_reason": finish_reason(o, None)}
                    if first and send_prompt_logprobs:
                        choice["prompt_logprobs"] = vllm_prompt_logprobs(engine, item)
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
