"""Intel GPUs (torch.xpu): device memory and synchronize from torch.xpu; torch's ops; decode runs
eager (no graph capture here yet)."""

from __future__ import annotations

from anna.platforms.base import Platform


class XpuPlatform(Platform):
    name = "xpu"
