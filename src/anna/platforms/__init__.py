"""One platform object per device kind, chosen once at start: ``resolve_platform(setting)``."""

from __future__ import annotations

import torch

from anna.platforms.base import KVBudget, MemoryInfo, Platform

__all__ = ["KVBudget", "MemoryInfo", "Platform", "resolve_platform"]


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def resolve_platform(name: str) -> Platform:
    """The platform of the ``device`` setting: auto picks cuda, then xpu, then cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "xpu" if _xpu_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
        from anna.platforms.cuda import CudaPlatform
        return CudaPlatform(torch.device("cuda"))
    if name == "xpu":
        if not _xpu_available():
            raise ValueError("device: 'xpu' was asked for but torch sees no XPU device")
        from anna.platforms.xpu import XpuPlatform
        return XpuPlatform(torch.device("xpu"))
    if name == "cpu":
        from anna.platforms.cpu import CpuPlatform
        return CpuPlatform(torch.device("cpu"))
    raise ValueError(f"device: {name!r} is not one of auto, cpu, cuda, xpu")
