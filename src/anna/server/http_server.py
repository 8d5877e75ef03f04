"""``anna serve``'s HTTP server: uvicorn, with a header read timeout and a graceful shutdown that
drains requests in flight before cutting them with an error.

uvicorn limits idle keep-alive connections but not a client that sends its headers slowly (one
byte a minute keeps a connection and its buffers forever), and on shutdown it cancels the
requests still running after its timeout, so that they end without a response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from anna.core.config import ResolvedSettings
from anna.core.errors import RequestError
from anna.server.protocol import APIError

log = logging.getLogger(__name__)

CUT_GRACE_S = 3.0  # after cutting the requests left at shutdown: time for their error responses to go out


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a limit on the time from a request's first byte (or the
    connection's opening) to the end of its headers; past it the client gets 408 and is closed."""

    header_timeout = 30.0  # set per server by timed_protocol()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        """Arm the timer while the headers of a request are awaited, disarm it once they are in."""
        awaiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if awaiting and self._header_timer is None and self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)
        elif not awaiting:
            self._stop_header_timer()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        body = json.dumps(APIError(408, f"the request headers did not arrive within {self.header_timeout:g} s "
                                        "(header_read_timeout)", code="request_timeout").body()).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def timed_protocol(header_timeout: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout})


class AnnaServer(uvicorn.Server):
    """Shutdown (SIGTERM, SIGINT): stop accepting, give requests in flight ``shutdown_timeout``
    seconds, then end those left with a final error (an error event when streaming), and exit."""

    def __init__(self, config: uvicorn.Config, state: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.anna = state
        self.shutdown_timeout = shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # uvicorn raises the signal again once it has shut down, so that the process dies of it;
            # a drained shutdown is a clean exit (0) here
            self._captured_signals.clear()

    async def shutdown(self, sockets: list | None = None) -> None:
        self.anna.draining = True
        log.info("Shutting down: no new requests; %d in flight get up to %g s to finish (shutdown_timeout)",
                 len(self.server_state.tasks), self.shutdown_timeout)
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # closes idle keep-alive connections, the others after their response
        if not await self._tasks_done(self.shutdown_timeout) and self.anna.engine is not None:
            log.warning("Shutdown: ending the %d requests still in flight with an error", len(self.server_state.tasks))
            self.anna.engine.fail_all(RequestError("the server is shutting down", status=503))
            await self._tasks_done(CUT_GRACE_S)
        for task in self.server_state.tasks:
            task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _tasks_done(self, timeout: float) -> bool:
        tasks = set(self.server_state.tasks)
        if tasks and not self.force_exit:
            await asyncio.wait(tasks, timeout=timeout)
        return not self.server_state.tasks


def serve(settings: ResolvedSettings) -> int:
    """Run the server until it is stopped; the exit code: 0 after a shutdown, 1 if the model could
    not load or the engine stopped (so that a supervisor restarts it)."""
    from anna.server.app import create_app

    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            http=timed_protocol(settings.header_read_timeout))
    server = AnnaServer(config, app.state.anna, settings.shutdown_timeout)
    state = app.state.anna
    dead: list[BaseException] = []

    def stop_engine_dead(exc: BaseException) -> None:
        dead.append(exc)
        server.should_exit = True

    state.on_load_error = lambda: setattr(server, "should_exit", True)  # a model that cannot load: exit
    state.on_engine_dead = stop_engine_dead
    server.run()
    if isinstance(state.load_error, ValueError):
        raise state.load_error  # main() prints it as one line
    if dead:
        log.critical("exiting: the engine stopped (%s)", dead[0])
        return 1
    return 1 if state.load_error is not None else 0
