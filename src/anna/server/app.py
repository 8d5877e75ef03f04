"""The OpenAI-compatible HTTP server: the app, its lifespan (loading the engine in the
background), error handlers, middleware and routes. Each route hands its request to a serving
module (serving_chat.py, serving_completions.py, serving_tokens.py), as vLLM's entrypoints do."""

from __future__ import annotations

import logging
import threading

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from anna.core.config import ResolvedSettings
from anna.core.errors import EngineDeadError, RequestError
from anna.runtime.engine import LLMEngine
from anna.runtime.warmup import run_warmup
from anna.server.async_engine import AsyncEngine
from anna.server.common import ServerState, as_api_error, served_names
from anna.server.guard import RequestGuard
from anna.server.web_console import mount_console
from anna.server.metrics import EngineCollector, make_registry, render
from anna.server.openapi import document_request_bodies, mount_docs
from anna.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                  TokenizeRequest, error_response)
from anna.server.serving_chat import serve_chat
from anna.server.serving_completions import serve_completions
from anna.server.serving_messages import MessagesRequest, serve_count_tokens, serve_messages
from anna.server.serving_responses import ResponsesRequest, serve_input_items, serve_responses, serve_stored_response
from anna.server.serving_snapshot import serve_snapshot
from anna.server.serving_tokens import serve_detokenize, serve_model, serve_models, serve_tokenize

log = logging.getLogger(__name__)


def create_app(settings: ResolvedSettings, *, load_in_background: bool = True) -> FastAPI:
    state = ServerState(settings=settings, model_names=served_names(settings))
    registry = make_registry(EngineCollector(lambda: state.engine.engine if state.engine else None,
                                             state.model_name, settings.metrics_namespace))

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

    app = FastAPI(title="Anna", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.anna = state
    mount_docs(app)
    if settings.web_ui:
        mount_console(app)

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
        return await serve_models(state)

    @app.get("/v1/models/{name:path}")  # (a served name may be a path: the model directory by default)
    async def model(name: str) -> JSONResponse:
        return await serve_model(state, name)

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
        return await serve_tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return await serve_detokenize(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_chat(state, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_completions(state, request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_responses(state, request)

    @app.get("/snapshot")
    async def snapshot() -> Response:
        return serve_snapshot(state)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        return serve_stored_response(state, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return serve_stored_response(state, response_id, delete=True)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str) -> Response:
        return serve_input_items(state, response_id)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve_messages(state, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await serve_count_tokens(state, request)

    document_request_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                                  "/v1/messages": MessagesRequest, "/v1/responses": ResponsesRequest,
                                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest})
    return app
