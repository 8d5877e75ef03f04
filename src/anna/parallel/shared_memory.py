"""What the shared-memory collectives and command channel of one host's ranks share: a segment
in /dev/shm mapped by every rank, and the wait for another rank's flag."""

from __future__ import annotations

import mmap
import os
import time
from typing import Callable

SPIN_BEFORE_YIELD = 2000  # flag reads before a waiting rank yields its core
IDLE_AFTER_S = 0.05  # an idle wait then sleeps between reads: an idle server's ranks use no CPU
IDLE_SLEEP_S = 0.0005


def map_segment(path: str, nbytes: int) -> mmap.mmap:
    """The segment at ``path``, created (zero-filled) by whichever rank comes first."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def remove_segment(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def wait_until(ready: Callable[[], bool], alive: Callable[[], bool], idle: bool = False) -> None:
    """Spin, then yield the core (the other rank may be busy a while: a long prefill), then, for
    an ``idle`` wait (a command that may be minutes away), sleep; raise once ``alive`` says no."""
    spins, start = 0, None
    while not ready():
        spins += 1
        if spins <= SPIN_BEFORE_YIELD:
            continue
        start = start or time.monotonic()
        if idle and time.monotonic() - start > IDLE_AFTER_S:
            time.sleep(IDLE_SLEEP_S)
        else:
            os.sched_yield()
        if spins % 1000 == 0 and not alive():
            raise RuntimeError("the tensor-parallel group ended (another rank is gone)")
