"""The outermost layer of every request (inside CORS): who may call, how much and how slowly
they may send, and that whatever goes wrong inside answers in OpenAI's error JSON.

A plain ASGI middleware, so that streaming responses pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any, Callable

from anna.core.config import ResolvedSettings
from anna.server.protocol import APIError, error_response

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # answered without an API key: load balancers and supervisors probe it
# The web console's page and its scripts hold no data (what the page shows it reads from
# /snapshot and the API, with the key the page asks for): they load without a key.
CONSOLE_PAGE, CONSOLE_ASSETS = "/", "/console/"


class RequestGuard:
    def __init__(self, app: Any, settings: ResolvedSettings, draining: Callable[[], bool]) -> None:
        self.app = app
        self.key = settings.api_key.encode() if settings.api_key else None
        self.max_bytes = settings.max_request_bytes
        self.body_timeout = settings.body_read_timeout
        self.draining = draining
        self.web_ui = settings.web_ui

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await error_response(*refusal)(scope, receive, send)
            await self.app(scope, self._limited(receive), tracked_send)
        except Exception as exc:  # a bug behind a route: still OpenAI's shape, never a bare 500 page
            log.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            if not started:
                err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
                await error_response(err)(scope, receive, send)

    def _refusal(self, scope: dict) -> tuple[APIError, dict[str, str] | None] | None:
        """The error to answer at once without reading the body, if any."""
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        if self.key is not None and not self._open(path) and not self._authorized(headers):
            return (APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                  "'x-api-key: <key>')"), {"WWW-Authenticate": 'Bearer realm="anna"'})
        if self.draining() and path not in OPEN_PATHS:
            return APIError(503, "the server is shutting down"), {"Connection": "close"}
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return self._too_large(), {"Connection": "close"}
        return None

    def _open(self, path: str) -> bool:
        """Whether a path is answered without an API key."""
        return path in OPEN_PATHS or (self.web_ui and (path == CONSOLE_PAGE or path.startswith(CONSOLE_ASSETS)))

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        """``Authorization: Bearer KEY`` (the scheme in any case, RFC 9110) or ``x-api-key: KEY``;
        compared in constant time."""
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization")
        if auth is not None:
            scheme, _, credentials = auth.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                given = credentials.strip()
        return given is not None and hmac.compare_digest(given, self.key)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes (max_request_bytes)",
                        code="request_too_large")

    def _limited(self, receive: Callable) -> Callable:
        """``receive`` with the body size and body read time bounded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout if self.body_timeout > 0 else None
        received = 0
        body_done = False

        async def limited_receive() -> dict:
            nonlocal received, body_done
            if body_done or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                        "(body_read_timeout)", code="request_timeout") from None
            if message["type"] == "http.request" and not body_done:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
                body_done = not message.get("more_body", False)
            return message

        return limited_receive
