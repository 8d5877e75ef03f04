"""Schema-driven fuzzing of every route: schemathesis generates bodies from /openapi.json (valid
ones and ones that break it) and sends them to a live server. No answer may be a 5xx, every
error is OpenAI's JSON, and the engine must be alive and idle afterwards.

CI runs a bounded, derandomized sample (the "anna-ci" hypothesis profile). The full run:

    python -m pytest tests/test_fuzz.py -p no:randomly --hypothesis-profile=anna-fuzz-full
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis

from anna.core.config import ServeSettings
from anna.server.app import create_app
from test_server import auth, wait_idle

pytestmark = pytest.mark.fuzz

# The document the server serves, built without loading a model (the routes do not depend on it)
schema = schemathesis.openapi.from_dict(create_app(ServeSettings().resolve(env={})).openapi())


@schema.include(method="POST").parametrize()
def test_no_generated_body_gets_a_5xx(case, live_server):
    r = case.call(base_url=live_server, headers=auth(), timeout=120)
    assert r.status_code < 500, (case.path, case.body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], r.text[:300]


def test_the_server_is_alive_and_idle_after_fuzzing(live_server):
    wait_idle(live_server)
    assert httpx.get(live_server + "/health").json() == {"status": "ok"}
    r = httpx.post(live_server + "/v1/completions", headers=auth(), timeout=60,
                   json={"prompt": "still here", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
