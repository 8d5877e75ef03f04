"""Large host tensors on transparent huge pages.

On CPU the kernels stream every weight once per step and walk the KV cache's blocks, which a
long-running server scatters. With 4 KB pages each KV block is a page of its own and a weight
matrix thousands of them, and each page's address translation misses the TLB (a nested page walk
in a VM). Backed by 2 MB pages, int4 decode ran 1.04-1.12x faster at batch 1 and 1.04-1.05x at
16 streams, and decode attention over scattered blocks 1.17-1.22x (docs/BENCHMARKS.md). Linux
only (madvise); elsewhere, or for tensors under 2 MB, plain torch allocations.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
SUPPORTED = hasattr(mmap, "MADV_HUGEPAGE")  # Linux


def huge_page_zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in an anonymous mapping aligned to 2 MB and advised for huge
    pages. Like torch.empty on CPU, its pages cost memory only once written."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not SUPPORTED:
        return torch.zeros(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # private: a shared anonymous mapping is shmem, which transparent huge pages leave alone;
    # one huge page more than needed, to start at a 2 MB boundary
    area = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` alive as long as the tensor
    offset = -base.data_ptr() % HUGE_PAGE
    try:
        area.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError as exc:  # e.g. a kernel without transparent huge pages: small pages still work
        log.debug("madvise(MADV_HUGEPAGE) failed: %s", exc)
    return base[offset:offset + nbytes].view(dtype).view(shape)


def move_to_huge_pages(module: nn.Module) -> int:
    """Copy the module's CPU parameters and buffers of 2 MB or more into huge-page memory, in place
    (a tensor shared by two modules, as a tied embedding, moves once). Returns the bytes moved.
    Call it before anything keeps raw pointers to the tensors."""
    moved = 0
    if not SUPPORTED:
        return moved
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        nbytes = t.numel() * t.element_size()
        if id(t) in seen or t.device.type != "cpu" or nbytes < HUGE_PAGE or not t.is_contiguous():
            continue
        seen.add(id(t))
        copy = huge_page_zeros(t.shape, t.dtype)
        copy.copy_(t)
        t.data = copy
        moved += nbytes
    return moved
