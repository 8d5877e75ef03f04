"""Bounded thread pools for the text work of the HTTP side: chat templates, tokenization, grammar
compilation.

This work is CPU-bound and its size is the client's choice (a multi-megabyte /tokenize body takes
seconds), so it never runs on the event loop, and it runs on pools of its own: one for generation
requests, one for /tokenize and /detokenize, so that the second cannot delay the first. Each pool
has a queue limit; past it a request gets 503 at once instead of waiting behind the others.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from anna.server.protocol import APIError

T = TypeVar("T")


class TextPool:
    def __init__(self, name: str, workers: int, queue_limit: int) -> None:
        self.name = name
        self.capacity = workers + queue_limit  # running + waiting
        self.in_use = 0  # touched on the event loop only
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"anna-{name}")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.in_use >= self.capacity:
            raise APIError(503, f"the server is busy: {self.in_use} {self.name} jobs are running or waiting; "
                                "try again shortly", code="server_busy")
        self.in_use += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.in_use -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
