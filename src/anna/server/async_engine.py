"""The engine loop in its own thread, with an asyncio face for the HTTP side.

HTTP handlers never run model code: they hand requests to the loop through a queue and await
outputs on a per-request asyncio queue. The loop thread applies pending adds and aborts between
steps, so neither side ever waits on the other longer than a queue hand-off.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from anna.core.errors import EngineDeadError, RequestError
from anna.core.outputs import RequestOutput
from anna.core.sampling_params import SamplingParams
from anna.runtime.engine import LLMEngine
from anna.runtime.input_processor import ProcessedRequest

log = logging.getLogger(__name__)

# How long the idle loop commits fresh KV memory at a time before it looks for requests again: a
# request that arrives meanwhile waits at most about this long (one layer's pages commit at a time)
IDLE_COMMIT_SLICE_S = 0.02


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_dead: Callable[[BaseException], None] | None = None) -> None:
        """``on_dead``: called (from the loop thread) when the engine cannot go on, after every
        waiting request has been failed; ``anna serve`` exits non-zero then, so that a supervisor
        restarts it."""
        self.engine = engine
        self.on_dead = on_dead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="anna-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side ----
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; the prompt is checked and tokenized
        on the engine thread. Cancelling the consumer (a client disconnect) aborts the request and
        frees its KV blocks."""
        async for out in self._stream(request_id, ("add", request_id, prompt, params)):
            yield out

    async def generate_processed(self, processed: ProcessedRequest) -> AsyncIterator[RequestOutput]:
        """The same for a request the input processor already checked (the server's path)."""
        rid = processed.group.request_id
        async for out in self._stream(rid, ("add_processed", rid, processed)):
            yield out

    async def _stream(self, request_id: str, command: tuple) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise EngineDeadError(f"engine loop has stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        out_q: asyncio.Queue = asyncio.Queue()
        self._commands.put((*command, (loop, out_q)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has already let it go
                    raise item
                if item.error is not None:
                    finished = True
                    raise item.error
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def fail_all(self, error: RequestError) -> None:
        """End every request in flight with ``error`` (its caller gets it as a final error)."""
        self._commands.put(("fail_all", error))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # ---- loop thread ----
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] in ("add", "add_processed"):
                rid, stream = cmd[1], cmd[-1]
                try:
                    if cmd[0] == "add":
                        self.engine.add_request(rid, cmd[2], cmd[3])
                    else:
                        self.engine.add_processed(cmd[2])
                    self._streams[rid] = stream
                except Exception as exc:  # invalid request: report to its caller only
                    loop, q = stream
                    loop.call_soon_threadsafe(q.put_nowait, exc)
            elif cmd[0] == "fail_all":
                for rid, (loop, q) in list(self._streams.items()):
                    self.engine.abort_request(rid)
                    loop.call_soon_threadsafe(q.put_nowait, cmd[1])
                self._streams.clear()
            else:
                rid = cmd[1]
                self._streams.pop(rid, None)
                self.engine.abort_request(rid)

    def _coalesce(self) -> None:
        """When idle and configured to, wait a moment so that near-simultaneous requests share a batch."""
        s = self.engine.settings
        if not s.skip_batch_wait_when_idle and s.batch_wait_ms > 0:
            time.sleep(s.batch_wait_ms / 1000)

    def _log_stats(self) -> None:
        interval = self.engine.settings.log_stats_interval
        now = time.monotonic()
        if interval <= 0 or now - self._last_stats_log < interval:
            return
        snap = self.engine.snapshot()
        if snap.num_steps != self._last_stats_steps:
            self._last_stats_log, self._last_stats_steps = now, snap.num_steps  # idle servers stay quiet
            log.info("Running: %d, waiting: %d, KV usage: %.1f%%, prefix cache hits: %d/%d tokens. %s",
                     snap.num_running, snap.num_waiting, 100 * snap.kv_usage, snap.prefix_cache_hits,
                     snap.prefix_cache_queries, snap.stats.steps.summary())
            if snap.stats.spec.num_drafts:
                log.info(snap.stats.spec.summary())
            if self.engine.profiler is not None:
                log.info(self.engine.profiler.table())

    def _run(self) -> None:
        engine = self.engine
        self._last_stats_log = time.monotonic()
        self._last_stats_steps = 0
        try:
            while not self._stop:
                engine.check_ranks()  # a tensor-parallel rank that ended ends the server, idle or not
                self._log_stats()
                if not engine.has_unfinished_requests() and self._commands.empty():
                    engine.release_idle_memory(periodic=True)
                    more = engine.commit_idle_memory(IDLE_COMMIT_SLICE_S)
                    self._wake.wait(timeout=0.0 if more else 1.0)
                    self._wake.clear()
                    if self._stop:
                        break
                    if not self._commands.empty():
                        self._coalesce()
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    continue
                for out in engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    loop, q = stream
                    loop.call_soon_threadsafe(q.put_nowait, out)
        except BaseException as exc:  # the engine cannot go on: fail every waiting request loudly
            log.critical("engine loop stopped: %s", exc, exc_info=not isinstance(exc, EngineDeadError))
            self.error = exc
            dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine loop crashed: {exc!r}")
            while True:  # requests handed over but not yet added get the same answer
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] in ("add", "add_processed"):
                    self._streams[cmd[1]] = cmd[-1]
            for loop, q in self._streams.values():
                loop.call_soon_threadsafe(q.put_nowait, dead)
            self._streams.clear()
            if self.on_dead is not None:
                self.on_dead(exc)
