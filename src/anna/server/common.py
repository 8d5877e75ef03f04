"""What every route shares: the server's state, parsing and checking a request, sampling
parameters from its fields, waiting with disconnects, error mapping, SSE and usage, and the
per-choice output parser."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from pydantic import BaseModel, ValidationError

from anna.core.config import ResolvedSettings
from anna.core.errors import EngineDeadError, RequestError
from anna.core.outputs import CompletionOutput, RequestOutput
from anna.core.sampling_params import SamplingParams, StructuredOutputsParams
from anna.runtime.engine import LLMEngine
from anna.server.async_engine import AsyncEngine
from anna.server.json_body import parse_json_body
from anna.server.protocol import APIError, SamplingFields, StreamOptions
from anna.server.reasoning import REASONING_PARSERS
from anna.server.response_store import ResponseStore
from anna.server.text_pool import TextPool
from anna.server.tool_parsers import ParsedToolCall, ToolCallStreamer, ToolParser

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
    responses: ResponseStore = field(init=False)  # what previous_response_id and GET /v1/responses/{id} read

    def __post_init__(self) -> None:
        s = self.settings
        self.prompt_pool = TextPool("prompt", s.prompt_workers, s.text_queue_limit)
        self.tokenize_pool = TextPool("tokenize", s.tokenize_workers, s.text_queue_limit)
        self.responses = ResponseStore(s.responses_store_size)

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
    return validate_body(model, body)


def validate_body(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` as ``model``, or a 400 naming the first field that is wrong."""
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
    inputs = state.core.inputs
    defaults = inputs.sampling_defaults  # the model's generation_config, for the fields a request leaves out
    cap = defaults.get("max_tokens")  # max_new_tokens: a limit for every request, as in vLLM
    if cap is not None:
        room = max(inputs.max_model_len - num_prompt_tokens, 1)
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
            bad_words=req.bad_words, speculative=req.speculative,
            structured_outputs=structured, output_kind="cumulative" if req.stream else "final_only")
    except ValueError as exc:
        raise invalid_request(exc) from None
    return params


async def start_request(state: ServerState, request_id: str, prompt_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[RequestOutput]:
    """Check and prepare the request once, on the prompt pool (the input processor: lengths,
    token ids, bad words, the grammar), then hand it to the engine. A refusal is a 400 here,
    before any response starts."""
    try:
        processed = await state.prompt_pool.run(state.core.inputs.process, request_id, prompt_ids, params)
    except ValueError as exc:
        raise invalid_request(exc) from None
    return state.engine.generate_processed(processed)


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

    def __init__(self, tool_parser: type[ToolParser] | None, tools: list[dict[str, Any]] | None,
                 reasoning_parser: str, stream: bool = False, prompt_reasoning: str = "none",
                 forced: bool = False) -> None:
        """``tool_parser``: the format calls are read in (None: no tool calls are parsed);
        ``tools``: the request's; ``prompt_reasoning``: what the prompt left of a reasoning block
        (reasoning.prompt_reasoning); ``forced``: the output is calls (tool_choice required or a
        named function), so that nothing but reasoning and calls comes of it, even cut off."""
        self.forced = forced
        self.reasoning = REASONING_PARSERS[reasoning_parser](prompt_reasoning) \
            if reasoning_parser != "none" else None
        self.tools = tool_parser(tools) if tool_parser is not None else None
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
        return reasoning, "" if self.forced else content, deltas


def finish_reason(out: CompletionOutput, parser: ChoiceParser | None) -> str | None:
    if out.finish_reason is None:
        return None
    if parser is not None and parser.calls and out.finish_reason == "stop":
        return "tool_calls"
    if out.finish_reason == "abort":
        return "stop"
    return out.finish_reason
