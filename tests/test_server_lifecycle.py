"""/health before the model is ready and after it failed to load (in-process ASGI, no lifespan)."""

from __future__ import annotations

import asyncio

import httpx

from anna.core.config import ServeSettings
from anna.server.app import create_app


def get(app, path: str) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get(path)
    return asyncio.run(go())


def test_health_is_503_while_loading_and_routes_say_so(tmp_path):
    app = create_app(ServeSettings(model=str(tmp_path), api_key="k").resolve(env={}))
    r = get(app, "/health")  # lifespan not run: the model has not loaded
    assert r.status_code == 503 and r.json()["status"] == "loading"
    r = get(app, "/v1/models")
    assert r.status_code == 401  # auth is checked first, even while loading
    from anna import __version__
    r = get(app, "/version")  # as vLLM's; behind the API key like every route but /health
    assert r.status_code == 401
    no_key = create_app(ServeSettings(model=str(tmp_path)).resolve(env={}))
    assert get(no_key, "/version").json() == {"version": __version__}


def test_health_reports_a_failed_load(tmp_path):
    app = create_app(ServeSettings(model=str(tmp_path / "missing")).resolve(env={}), load_in_background=False)

    async def go():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await client.get("/health"), await client.get("/v1/models")

    health, models = asyncio.run(go())
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert models.status_code == 503 and "failed to load" in models.json()["error"]["message"]


def test_serve_refuses_to_start_when_one_sequence_does_not_fit(qwen2_dir, cache_dir):
    """`anna serve` exits (code 2) with the largest max_model_len that fits, rather than serving 503s."""
    import subprocess
    import sys

    from conftest import free_port

    cmd = [sys.executable, "-m", "anna.cli.main", "serve", str(qwen2_dir), "--port", str(free_port()),
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "4",
           "--block-size", "16", "--cache-dir", str(cache_dir), "--log-level", "warning"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "anna: error: max_model_len:" in done.stderr and "the largest max_model_len that fits is 64" in done.stderr


def test_cors_preflight_is_answered_before_the_api_key(tmp_path):
    def request(app, method: str, path: str, headers: dict) -> httpx.Response:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await client.request(method, path, headers=headers)
        return asyncio.run(go())

    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    app = create_app(ServeSettings(model=str(tmp_path), api_key="k").resolve(env={}))
    r = request(app, "OPTIONS", "/v1/chat/completions", preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "https://ui.example")
    r = request(app, "GET", "/v1/models", {"Origin": "https://ui.example"})
    assert r.status_code == 401 and "access-control-allow-origin" in r.headers  # the browser can read the error
    only = create_app(ServeSettings(model=str(tmp_path), allowed_origins="https://a.example").resolve(env={}))
    assert request(only, "OPTIONS", "/v1/models", preflight).status_code == 400
    none = create_app(ServeSettings(model=str(tmp_path), allowed_origins="").resolve(env={}))
    assert "access-control-allow-origin" not in request(none, "GET", "/health", {"Origin": "https://ui.example"}).headers
