"""What the first write to fresh host memory costs here, in huge pages and in small ones.

    python benchmarks/first_touch_bench.py --mib 512

Anna's KV pool is reserved up front and committed lazily (a page costs RAM once a block in it is
first written), and on huge pages (cpu_huge_pages) a decode step that starts a new block may be
the first to write a 2 MB page of each layer's K and V. On bare metal that page costs its zeroing
(a fraction of a millisecond); in a VM whose host backs guest memory only on first use, it can cost
far more, and the step that writes it waits. Each round allocates --mib MiB on huge pages
(platforms/cpu/host_memory.huge_page_zeros) and writes one byte per 2 MB, then the same on small
pages (torch.empty, one byte per 4 KB), and frees both; later rounds usually get memory the
process has already touched back from the allocator. Prints ms per 2 MB for each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from anna.platforms.cpu.host_memory import HUGE_PAGE, huge_page_zeros

SMALL_PAGE = 4096


def touch_ms_per_2mb(t: torch.Tensor, stride: int) -> list[float]:
    """Write one byte every ``stride`` bytes; the time of each 2 MB's writes, in ms."""
    out = []
    for start in range(0, t.numel(), HUGE_PAGE):
        t0 = time.perf_counter()
        t[start:start + HUGE_PAGE:stride] = 1
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    nbytes = args.mib << 20
    rows = []
    for r in range(args.rounds):
        for pages, make, stride in (("huge", lambda: huge_page_zeros((nbytes,), torch.uint8), HUGE_PAGE),
                                    ("small", lambda: torch.empty(nbytes, dtype=torch.uint8), SMALL_PAGE)):
            t = make()
            times = touch_ms_per_2mb(t, stride)
            rows.append({"round": r, "pages": pages, "ms_per_2mb_median": round(statistics.median(times), 3),
                         "ms_per_2mb_max": round(max(times), 3), "total_ms": round(sum(times), 1)})
            del t
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
