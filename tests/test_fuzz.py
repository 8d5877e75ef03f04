"""Schema-driven fuzzing of every route: schemathesis generates bodies from /openapi.json (valid
ones and ones that break it) and sends them to a live server. No answer may be a 5xx, every
error is OpenAI's JSON, and the engine must be alive and idle afterwards. The server under fuzz caps
every request's output at a few tokens (max_new_tokens in its generation config, as a deployment
would): what is checked is how bodies are taken, not how long the model writes.

CI runs a bounded, derandomized sample (the "anna-ci" hypothesis profile). The full run:

    python -m pytest tests/test_fuzz.py -p no:randomly --hypothesis-profile=anna-fuzz-full
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis

from anna.core.config import ServeSettings
from anna.server.app import create_app
from conftest import LIVE_SERVER_ARGS, launch_server, stop_server
from test_server import auth, wait_idle

pytestmark = pytest.mark.fuzz

# The document the server serves, built without loading a model (the routes do not depend on it)
schema = schemathesis.openapi.from_dict(create_app(ServeSettings().resolve(env={})).openapi())
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def fuzz_server(qwen2_dir, cache_dir, tmp_path_factory):
    """The session's live server's settings, with generation capped at MAX_NEW_TOKENS."""
    folder = tmp_path_factory.mktemp("fuzz_generation_config")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": MAX_NEW_TOKENS}))
    proc, base = launch_server(qwen2_dir, cache_dir, folder / "server.log", *LIVE_SERVER_ARGS,
                               "--generation-config", str(folder))
    yield base
    stop_server(proc)


@schema.include(method="POST").parametrize()
def test_no_generated_body_gets_a_5xx(case, fuzz_server):
    r = case.call(base_url=fuzz_server, headers=auth(), timeout=120)
    assert r.status_code < 500, (case.path, case.body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], r.text[:300]


def test_the_server_is_alive_and_idle_after_fuzzing(fuzz_server):
    wait_idle(fuzz_server)
    assert httpx.get(fuzz_server + "/health").json() == {"status": "ok"}
    r = httpx.post(fuzz_server + "/v1/completions", headers=auth(), timeout=60,
                   json={"prompt": "still here", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    r = httpx.post(fuzz_server + "/v1/completions", headers=auth(), timeout=60,
                   json={"prompt": "capped", "max_tokens": 100, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_NEW_TOKENS
