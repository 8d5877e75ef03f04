"""POST /tokenize and /detokenize (vLLM's), on their own thread pool so that they cannot delay
generation, and GET /v1/models."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from anna.server.common import ServerState, check_model, parse_body
from anna.server.protocol import APIError, DetokenizeRequest, TokenizeRequest
from anna.server.serving_chat import chat_prompt_ids


async def serve_tokenize(state: ServerState, request: Request) -> JSONResponse:
    """POST /tokenize: a prompt or chat messages to token ids."""
    req = await parse_body(request, TokenizeRequest)
    check_model(state, req.model)
    engine = state.core
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids, _ = await chat_prompt_ids(state.tokenize_pool, engine, req, tools)
    elif req.prompt is not None:
        ids = await state.tokenize_pool.run(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
    else:
        raise APIError(400, "prompt: give 'prompt' or 'messages'", param="prompt")
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})


async def serve_detokenize(state: ServerState, request: Request) -> JSONResponse:
    """POST /detokenize."""
    req = await parse_body(request, DetokenizeRequest)
    check_model(state, req.model)
    engine = state.core
    vocab = engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"tokens: ids must be in 0..{vocab - 1}", param="tokens")
    text = await state.tokenize_pool.run(engine.tokenizer.decode, req.tokens, False)
    return JSONResponse({"prompt": text})


def model_card(state: ServerState, name: str) -> dict:
    engine = state.core
    return {"id": name, "object": "model", "created": state.created, "owned_by": "anna", "root": engine.model_dir,
            "max_model_len": engine.max_model_len}


async def serve_models(state: ServerState) -> JSONResponse:
    """GET /v1/models: every served name, one model."""
    return JSONResponse({"object": "list", "data": [model_card(state, name) for name in state.model_names]})


async def serve_model(state: ServerState, name: str) -> JSONResponse:
    """GET /v1/models/{id} (the openai SDK's models.retrieve); a name this server does not serve
    is a 404 that lists the ones it does."""
    check_model(state, name)
    return JSONResponse(model_card(state, name))
