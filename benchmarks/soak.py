"""Soak: many concurrent clients for a long time, mixing normal, streaming, aborted and bad
requests, against one `anna serve`; records success rate, latency, the server's RSS over time
and whether the KV cache returns to idle at the end.

    python benchmarks/soak.py --duration 600 --clients 32            # starts the demo model
    python benchmarks/soak.py --model benchmarks/models/qwen2.5-0.5b  # or any model directory
    python benchmarks/soak.py --url http://127.0.0.1:8000             # or a server already running

Every request goes to 127.0.0.1 and has a timeout; the run stops by itself after --duration.
"Success" means the outcome the request should have: a 200 with output for a normal request, a
stream ending in [DONE] without an error for a streaming one, a 4xx in OpenAI's error shape for a
bad one, any answer but a 5xx for an aborted one. Results: printed, and written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hostile_requests import hostile_requests, runtime_failure_request  # noqa: E402

KINDS = {"chat": 3, "completion": 2, "stream": 3, "aborted_stream": 1, "client_timeout": 1, "bad": 2,
         "fails_while_running": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("anna:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0] if "finished_reason" not in name and "status" not in name else name] = float(value)
    return out


class Soak:
    def __init__(self, base: str, clients: int, duration: float, max_tokens: int, seed: int) -> None:
        self.base, self.clients, self.duration, self.max_tokens = base, clients, duration, max_tokens
        self.rng = random.Random(seed)
        self.hostile = hostile_requests()
        self.results: dict[str, dict] = {k: {"count": 0, "ok": 0, "latencies": [], "failures": []} for k in KINDS}
        self.bad_runtime: dict | None = None

    def record(self, kind: str, ok: bool, latency: float | None, why: str = "") -> None:
        r = self.results[kind]
        r["count"] += 1
        r["ok"] += ok
        if latency is not None and ok:
            r["latencies"].append(latency)
        if not ok and len(r["failures"]) < 20:
            r["failures"].append(why[:300])

    async def one(self, client: httpx.AsyncClient, kind: str) -> None:
        n = self.rng.randrange(4, self.max_tokens + 1)
        prompt = f"soak request {self.rng.randrange(10**6)} " * self.rng.randrange(1, 20)
        t0 = time.perf_counter()
        try:
            if kind in ("chat", "completion"):
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                body = {"max_tokens": n, "ignore_eos": True, "temperature": self.rng.choice([0, 0.7])}
                body.update({"messages": [{"role": "user", "content": prompt}]} if kind == "chat" else {"prompt": prompt})
                r = await client.post(path, json=body, timeout=120)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n
                self.record(kind, ok, time.perf_counter() - t0, f"{r.status_code} {r.text[:200]}")
            elif kind in ("stream", "aborted_stream"):
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "ignore_eos": True,
                        "stream": True}
                cut = self.rng.randrange(1, 4) if kind == "aborted_stream" else None
                lines = []
                async with client.stream("POST", "/v1/chat/completions", json=body, timeout=120) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            if cut is not None and len(lines) >= cut:
                                break
                if kind == "stream":
                    ok = r.status_code == 200 and lines[-1] == "[DONE]" and not any('"error"' in x for x in lines)
                else:
                    ok = r.status_code < 500
                self.record(kind, ok, time.perf_counter() - t0, f"{r.status_code} {lines[-2:]}")
            elif kind == "client_timeout":  # the client gives up long before the answer
                try:
                    await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": self.max_tokens * 4,
                                                              "ignore_eos": True}, timeout=0.05)
                    self.record(kind, True, None)
                except httpx.TimeoutException:
                    self.record(kind, True, None)
            else:
                if kind == "bad":
                    name, path, raw = self.rng.choice(self.hostile)
                else:
                    name, path, raw = "fails while running", "/v1/completions", json.dumps(self.bad_runtime).encode()
                r = await client.post(path, content=raw, headers={"content-type": "application/json"}, timeout=120)
                ok = r.status_code < 500 and (r.status_code < 400 or "error" in r.json())
                if kind == "fails_while_running":
                    ok = ok and r.status_code == 400
                self.record(kind, ok, None, f"{name}: {r.status_code} {r.text[:200]}")
        except httpx.TimeoutException as exc:
            self.record(kind, False, None, f"timeout: {exc!r}")
        except httpx.TransportError as exc:
            self.record(kind, False, None, f"transport: {exc!r}")

    async def client_loop(self, client: httpx.AsyncClient, until: float) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        while time.monotonic() < until:
            await self.one(client, self.rng.choices(kinds, weights)[0])

    async def run(self, server_pid: int | None) -> dict:
        async with httpx.AsyncClient(base_url=self.base, limits=httpx.Limits(max_connections=self.clients * 2)) as c:
            ids = [(await c.post("/tokenize", json={"prompt": t, "add_special_tokens": False})).json()["tokens"]
                   for t in ("a", "bb")]
            self.bad_runtime = runtime_failure_request((ids[0][0], ids[1][0]))
            rss: list[tuple[float, float | None, float]] = []
            start = time.monotonic()
            until = start + self.duration

            async def sample() -> None:
                while time.monotonic() < until:
                    m = parse_metrics((await c.get("/metrics")).text)
                    rss.append((round(time.monotonic() - start, 1), server_pid and rss_mib(server_pid),
                                m.get("anna:kv_cache_usage_perc", 0.0)))
                    await asyncio.sleep(5)

            await asyncio.gather(sample(), *(self.client_loop(c, until) for _ in range(self.clients)))
            idle_deadline = time.monotonic() + 60
            while True:  # the engine must come back to idle on its own
                m = parse_metrics((await c.get("/metrics")).text)
                idle = m["anna:num_requests_running"] == 0 and m["anna:num_requests_waiting"] == 0 \
                    and m["anna:kv_cache_usage_perc"] == 0
                if idle or time.monotonic() > idle_deadline:
                    break
                await asyncio.sleep(0.5)
            health = (await c.get("/health")).json()
            final = await c.post("/v1/completions", json={"prompt": "after the soak", "max_tokens": 4,
                                                          "ignore_eos": True}, timeout=60)
        return self.report(rss, m, idle, health, final.status_code, server_pid)

    def report(self, rss, m, idle, health, final_status, pid) -> dict:
        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            values = sorted(values)
            return round(values[min(len(values) - 1, int(q * len(values)))], 3)

        kinds = {}
        for kind, r in self.results.items():
            kinds[kind] = {"count": r["count"], "ok": r["ok"], "success_rate": round(r["ok"] / max(1, r["count"]), 4),
                           "p50_s": pct(r["latencies"], 0.5), "p99_s": pct(r["latencies"], 0.99),
                           "failures": r["failures"]}
        total = sum(r["count"] for r in self.results.values())
        ok = sum(r["ok"] for r in self.results.values())
        return {"cpu": cpu_model(), "clients": self.clients, "duration_s": self.duration,
                "requests": total, "success_rate": round(ok / max(1, total), 4), "kinds": kinds,
                "rss_mib_over_time": rss, "rss_mib_first": rss[0][1] if rss else None,
                "rss_mib_last": rss[-1][1] if rss else None,
                "end": {"idle": idle, "running": m["anna:num_requests_running"],
                        "waiting": m["anna:num_requests_waiting"], "kv_cache_usage_perc": m["anna:kv_cache_usage_perc"],
                        "health": health, "request_after": final_status,
                        "failures_400": m.get('anna:request_failure_total{model_name="soak",status="400"}'),
                        "aborted": m.get("anna:request_aborted_total")},
                "server_pid": pid}


def start_server(args: list[str], log_path: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start `anna serve ARGS` on a free loopback port; wait (bounded) until /health says ok."""
    port = free_port()
    cmd = [sys.executable, "-m", "anna.cli.main", "serve", *args, "--port", str(port), "--log-level", "warning"]
    with open(log_path or os.devnull, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ANNA_API_KEY": ""})
    base = f"http://127.0.0.1:{port}"
    if not wait_healthy(proc, base):
        proc.kill()
        raise SystemExit(f"the server did not start{f'; see {log_path}' if log_path else ''}")
    return proc, base


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 300.0) -> bool:
    """Until the server at `base` answers 200 on /health (True), or `proc` exits or the time is up (False).
    Anna, llama-server and vLLM all answer 503 there while loading."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    return False


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="A server already running (else one is started here).")
    ap.add_argument("--model", help="Model directory for the server started here (default: the demo model).")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=600.0, help="Seconds of load.")
    ap.add_argument("--max-tokens", type=int, default=32, help="Most tokens a normal request asks for.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results", help="Folder for the JSON result.")
    args = ap.parse_args()

    proc, base = None, args.url
    if base is None:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        proc, base = start_server([*([args.model] if args.model else []), "--served-model-name", "soak"],
                                  Path(args.out) / "soak-server.log")
    try:
        result = asyncio.run(Soak(base, args.clients, args.duration, args.max_tokens, args.seed).run(
            proc.pid if proc else None))
    finally:
        if proc is not None:
            proc.terminate()
            exit_code = proc.wait(timeout=60)
            print(f"server exit code after SIGTERM: {exit_code}")
    if proc is not None:
        result["server_exit_code_after_sigterm"] = exit_code
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("rss_mib_over_time", "kinds")}
    summary["kinds"] = {k: {x: y for x, y in v.items() if x != "failures"} for k, v in result["kinds"].items()}
    print(json.dumps(summary, indent=1))
    for kind, v in result["kinds"].items():
        for why in v["failures"][:3]:
            print(f"failure ({kind}): {why}")
    print(f"written to {out}")
    return 0 if result["success_rate"] == 1.0 and result["end"]["idle"] else 1


if __name__ == "__main__":
    sys.exit(main())
