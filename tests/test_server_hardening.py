"""The HTTP server against hostile and sloppy clients: every answer is a 2xx or OpenAI's error
JSON with a 4xx, the engine survives, the request beside a bad one is unchanged; the limits on
body size and read time hold; the API key is read as clients send it; /openapi.json describes
every body; SIGTERM drains, then cuts with an error, and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest

from anna.server.protocol import APIError
from anna.server.text_pool import TextPool
from conftest import SERVER_API_KEY as API_KEY
from conftest import launch_server, stop_server
from hostile_requests import hostile_requests, runtime_failure_request
from test_server import auth, metrics, wait_idle


def post(base: str, path: str, body: bytes | dict, timeout: float = 60, **headers: str) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + path, content=raw, timeout=timeout,
                      headers={"content-type": "application/json", **auth(), **headers})


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text[:200])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if status is not None:
        assert r.status_code == status, (r.status_code, err)
    return err


def greedy_text(base: str, prompt: str, n: int = 24) -> str:
    r = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def letter_ids(base: str) -> tuple[int, int]:
    """The ids of "a" and "b", after checking "a" and "bb" tokenize as runtime_failure_request needs."""
    def ids(text: str) -> list[int]:
        return post(base, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    a, bb = ids("a"), ids("bb")
    assert len(a) == 1 and len(bb) == 2 and bb[0] == bb[1] != a[0], (a, bb)
    return a[0], bb[0]


def test_every_hostile_request_gets_a_2xx_or_a_4xx_in_openai_shape(live_server):
    before = greedy_text(live_server, "the same request before and after")
    statuses: dict[int, int] = {}
    for name, path, body in hostile_requests():
        r = post(live_server, path, body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (name, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert_openai_error(r)
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 5, statuses
    assert httpx.get(live_server + "/health").json() == {"status": "ok"}
    assert greedy_text(live_server, "the same request before and after") == before
    wait_idle(live_server)


def test_a_request_failing_while_it_runs_is_a_400_and_its_neighbour_is_unchanged(live_server):
    prompt = "a neighbour streams beside a bad request"
    alone = greedy_text(live_server, prompt, 40)
    bad = runtime_failure_request(letter_ids(live_server))
    before = metrics(live_server)

    async def main():
        async with httpx.AsyncClient(base_url=live_server, headers=auth(), timeout=60) as client:
            async def stream() -> str:
                text = ""
                body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text
            return await asyncio.gather(stream(), client.post("/v1/completions", json=bad),
                                        client.post("/v1/completions", json={**bad, "stream": True}))

    text, failed, failed_stream = asyncio.run(main())
    assert text == alone
    err = assert_openai_error(failed, 400)
    assert err["param"] == "allowed_token_ids" and "bad_words" in err["message"]
    events = [line for line in failed_stream.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2][6:])["error"]["param"] == "allowed_token_ids" and events[-1] == "data: [DONE]"
    after = wait_idle(live_server)
    assert after['anna:request_failure_total{status="400"}'] == before['anna:request_failure_total{status="400"}'] + 2
    assert httpx.get(live_server + "/health").json() == {"status": "ok"}


def test_the_api_key_is_read_as_clients_send_it(live_server):
    body = {"prompt": "k", "max_tokens": 1}
    for headers in ({"Authorization": f"Bearer {API_KEY}"}, {"Authorization": f"bearer {API_KEY}"},
                    {"Authorization": f"BEARER  {API_KEY}"}, {"x-api-key": API_KEY}):
        r = httpx.post(live_server + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, (headers, r.text)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"x-api-key": "wrong"}, {"Authorization": API_KEY}, {"Authorization": "Bearer \xe9".encode("latin-1")}):
        r = httpx.post(live_server + "/v1/completions", json=body, headers=headers, timeout=30)
        assert_openai_error(r, 401)
        assert r.headers["www-authenticate"].lower().startswith("bearer")


def test_openapi_describes_every_request_body(live_server):
    doc = httpx.get(live_server + "/openapi.json", headers=auth()).json()
    schemas = doc["components"]["schemas"]
    expected = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/tokenize": "prompt",
                "/detokenize": "tokens"}
    for path, field in expected.items():
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        model = schemas[ref.rsplit("/", 1)[1]]
        assert field in model["properties"], (path, sorted(model["properties"]))
    assert "max_tokens" in schemas["ChatCompletionRequest"]["properties"]


@pytest.fixture(scope="module")
def strict_server(qwen2_dir, cache_dir, tmp_path_factory):
    """A server with small limits, to test them quickly."""
    log = tmp_path_factory.mktemp("strict") / "server.log"
    proc, base = launch_server(qwen2_dir, cache_dir, log, "--max-request-bytes", "4096", "--header-read-timeout",
                               "0.5", "--body-read-timeout", "0.5", "--no-inference-warmup",
                               "--num-gpu-blocks-override", "64")
    yield base
    stop_server(proc)


def raw_exchange(base: str, data: bytes, timeout: float = 20) -> bytes:
    """Send raw bytes, then read until the server closes the connection (bounded)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_bodies_over_the_limit_get_413(strict_server):
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    r = httpx.post(strict_server + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_openai_error(r, 413)

    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(strict_server + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413)
    r = httpx.post(strict_server + "/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_slow_headers_and_slow_bodies_get_408(strict_server):
    answer = raw_exchange(strict_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"header_read_timeout" in answer
    answer = raw_exchange(strict_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                         b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")  # the body never ends
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"body_read_timeout" in answer
    assert httpx.get(strict_server + "/health").json() == {"status": "ok"}


def test_a_full_text_pool_answers_503_at_once_and_pools_are_independent():
    release = threading.Event()

    async def main():
        tokenize, prompt = TextPool("tokenize", 1, 1), TextPool("prompt", 1, 1)
        first = asyncio.ensure_future(tokenize.run(release.wait))  # running
        second = asyncio.ensure_future(tokenize.run(release.wait))  # waiting
        await asyncio.sleep(0)
        with pytest.raises(APIError) as busy:
            await tokenize.run(lambda: None)
        assert await prompt.run(lambda: "served") == "served"  # the other pool is not held up
        release.set()
        assert await first and await second
        assert await tokenize.run(lambda: "again") == "again"
        tokenize.shutdown()
        prompt.shutdown()
        return busy.value

    err = asyncio.run(main())
    assert err.status == 503 and err.code == "server_busy"


def test_sigterm_drains_requests_then_cuts_the_rest_with_an_error_and_exits_0(qwen2_dir, cache_dir, tmp_path):
    proc, base = launch_server(qwen2_dir, cache_dir, tmp_path / "server.log", "--shutdown-timeout", "0.5",
                               "--max-num-seqs", "1", "--no-inference-warmup", "--num-gpu-blocks-override", "96")
    results: dict[str, object] = {}

    def stream(name: str, max_tokens: int, started: threading.Event | None = None) -> None:
        body = {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if started is not None:
                        started.set()
        results[name] = lines

    def complete(name: str) -> None:
        results[name] = httpx.post(base + "/v1/completions", json={"prompt": name, "max_tokens": 480,
                                                                  "ignore_eos": True}, timeout=60)

    started = threading.Event()
    threads = [threading.Thread(target=stream, args=("short", 8, started))]
    threads[0].start()
    assert started.wait(30)
    threads += [threading.Thread(target=stream, args=(f"long{i}", 480)) for i in range(3)]
    threads += [threading.Thread(target=complete, args=(f"plain{i}",)) for i in range(2)]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 30
    while metrics(base)["anna:num_requests_waiting"] + metrics(base)["anna:num_requests_running"] < 5:
        assert time.monotonic() < deadline
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(timeout=60) == 0

    short = results["short"]
    assert short[-1] == "[DONE]" and all("error" not in json.loads(x) for x in short[:-1])
    cut = 0
    for i in range(3):
        lines = results[f"long{i}"]
        assert lines[-1] == "[DONE]", lines[-3:]
        last = json.loads(lines[-2])
        if "error" in last:
            cut += 1
            assert "shutting down" in last["error"]["message"]
    for i in range(2):
        r = results[f"plain{i}"]
        if r.status_code != 200:
            cut += 1
            assert "shutting down" in assert_openai_error(r, 503)["message"]
    assert cut >= 1  # 5 x 480 tokens one at a time take longer than the 0.5 s drain
