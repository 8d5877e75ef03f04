"""The sums and gathers between the ranks of a tensor-parallel model.

``Collectives`` goes through torch.distributed's default group (gloo, NCCL, XCCL). Ranks on one
host with CPU tensors use ``SharedMemoryCollectives``: every rank writes its tensor into its slot
of one shared-memory segment, raises its flag, waits for the others' and sums the slots in rank
order (so every rank holds the same bits). gloo's TCP round trip over loopback costs 1.1-2.8 ms a
call on a 2-core VM whatever the size (benchmarks/tensor_parallel_bench.py --collectives), which
for a 24-layer model's 49 calls per decode step is longer than the step's matmuls; the shared
segment costs microseconds. Tensors larger than a slot still go through gloo.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from anna.parallel.shared_memory import map_segment, remove_segment, wait_until

SLOT_BYTES = 8 << 20  # per rank and phase: a decode step's hidden rows and logits slices fit


class Collectives:
    """torch.distributed's collectives over the default group. Counts calls, bytes and wall time
    (waiting for the slowest rank included), which the tensor-parallel benchmark reports."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = self.bytes = 0
        self.seconds = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        start = time.perf_counter()
        self._all_reduce(x)
        self._count(x, start)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors side by side along the last dimension, in rank order."""
        start = time.perf_counter()
        out = self._all_gather(x.contiguous())
        self._count(x, start)
        return out

    def close(self) -> None:
        pass

    def _all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x)

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def _count(self, x: torch.Tensor, start: float) -> None:
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.bytes += x.numel() * x.element_size()


class SharedMemoryCollectives(Collectives):
    """Collectives of ranks on one host through a shared-memory segment (see the module's doc).

    Layout: flags int64 [2 phases, size], then slots [2 phases, size, SLOT_BYTES]. Call ``seq``
    uses phase seq % 2: a rank writes its slot, sets its flag to seq, waits until every flag of
    the phase is seq, then reads all slots. A rank can start call seq + 2 (the same phase) only
    after every rank has flagged seq + 1, i.e. has finished reading call seq: two phases suffice.
    ``alive`` is asked while waiting: False (a rank ended) raises instead of waiting forever."""

    def __init__(self, size: int, rank: int, path: str, alive: Callable[[], bool] | None = None) -> None:
        super().__init__(size)
        self.rank, self.path = rank, path
        self.alive = alive or (lambda: True)
        header = 2 * size * 8
        self._map = map_segment(path, header + 2 * size * SLOT_BYTES)
        self.flags = np.frombuffer(self._map, dtype=np.int64, count=2 * size).reshape(2, size)
        self.slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=header,
                                      count=2 * size * SLOT_BYTES).view(2, size, SLOT_BYTES)
        self.seq = 0

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x`` and wait for every rank's; their tensors, in rank order (views)."""
        self.seq += 1
        phase, nbytes = self.seq % 2, x.numel() * x.element_size()
        slots = self.slots[phase]
        slots[self.rank, :nbytes].view(x.dtype).view(x.shape).copy_(x)
        self.flags[phase, self.rank] = self.seq
        self._wait(phase)
        return [slots[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]

    def _wait(self, phase: int) -> None:
        flags, seq = self.flags[phase], self.seq
        for r in range(self.size):
            wait_until(lambda r=r: flags[r] >= seq, self.alive)

    def _all_reduce(self, x: torch.Tensor) -> None:
        if not self.fits(x):
            return super()._all_reduce(x)
        parts = self._exchange(x)
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fits(x):
            return super()._all_gather(x)
        return torch.cat(self._exchange(x), dim=-1)

    def close(self) -> None:
        if self.rank == 0:
            remove_segment(self.path)
