"""The errors that cross from the engine to its callers.

A request that fails ends on its own: the engine finishes it with a :class:`RequestError` and
every other request goes on. Only :class:`EngineDeadError` means the engine itself cannot go on.
"""

from __future__ import annotations


class RequestError(Exception):
    """One request failed while it ran. ``status`` is what an HTTP caller gets: 400 when its own
    input caused it (``param`` names the field), 500 when it is Anna's fault."""

    def __init__(self, message: str, status: int = 500, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def as_exception(self, where: str = "") -> Exception:
        """What a library caller gets: ValueError when the input caused it, RuntimeError otherwise."""
        return (ValueError if self.status < 500 else RuntimeError)(self.message + where)

    @classmethod
    def internal(cls, exc: BaseException) -> "RequestError":
        """An unexpected exception while serving one request, as that request's error."""
        return cls(f"internal error while serving this request: {type(exc).__name__}: {exc}")


class EngineDeadError(RuntimeError):
    """The engine cannot serve any request any more (its device is lost, or it keeps failing)."""
