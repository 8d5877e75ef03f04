"""Weight-only quantization formats (symmetric, no zero point).

int8: one fp32 scale per output row (group 0), or one fp16 scale per group of ``group`` input
columns (a GGUF's Q8_0 is group 32), q in [-127, 127].
int4: one fp16 scale per group of ``group`` input columns (as llama.cpp's Q4_0: fp32 scales made
int4 weights 10% larger and batch-1 decode, which reads them all, 5-9% slower), q in [-8, 7]
stored as q + 8 in a nibble; each run of 32 weights is 16 bytes, byte i holding weight i (low
nibble) and weight i + 16 (high nibble), the layout the AVX2 kernels unpack with one shift and
one mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_BLOCK = 32  # weights per 16-byte packed run
INT4_GROUP_SIZES = (32, 64, 128)


def quantize_int8(w: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    if not group:
        scale = wf.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        return torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale
    n, k = w.shape
    if group not in INT4_GROUP_SIZES or k % group:
        raise ValueError(f"int8_group_size: {group} must be one of {INT4_GROUP_SIZES} and divide {k}")
    g = wf.view(n, k // group, group)
    scale = (g.abs().amax(dim=2) / 127.0).clamp_(2.0 ** -24, torch.finfo(torch.float16).max).to(torch.float16)
    return torch.round(g / scale.float()[:, :, None]).clamp_(-127, 127).to(torch.int8).view(n, k), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, group: int = 0) -> torch.Tensor:
    if not group:
        return q.float() * scale[:, None]
    n, k = q.shape
    return (q.float().view(n, k // group, group) * scale.float()[:, :, None]).view(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] values 0..15 (uint8) -> [N, K/2] packed bytes."""
    n, k = q.shape
    runs = q.view(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (runs[:, :, 0, :] | (runs[:, :, 1, :] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] packed bytes -> [N, K] values 0..15."""
    n, half = packed.shape
    runs = packed.view(n, half // (INT4_BLOCK // 2), INT4_BLOCK // 2)
    return torch.stack((runs & 0x0F, runs >> 4), dim=2).reshape(n, half * 2)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    if group not in INT4_GROUP_SIZES or k % group:
        raise ValueError(f"int4_group_size: {group} must be one of {INT4_GROUP_SIZES} and divide {k}")
    g = w.float().view(n, k // group, group)
    # at least the smallest fp16 subnormal (2^-24), so that an all-zero group does not divide by 0
    scale = (g.abs().amax(dim=2) / 7.0).clamp_(2.0 ** -24, torch.finfo(torch.float16).max).to(torch.float16)
    q = torch.round(g / scale.float()[:, :, None]).clamp_(-8, 7).add_(8).to(torch.uint8).view(n, k)
    return pack_int4(q), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    q = unpack_int4(packed).float() - 8.0
    n, k = q.shape
    return (q.view(n, k // group, group) * scale.float()[:, :, None]).view(n, k)


@dataclass(frozen=True)
class PackedWeight:
    """A weight that a checkpoint already stores in one of Anna's formats (a GGUF's Q4_0 or Q8_0,
    a symmetric GPTQ's groups): ``method`` int4 (values packed [N, K/2] as ``pack_int4`` writes
    them) or int8 (values [N, K]), with fp16 scales [N, K/group]. A QuantLinear of the same
    method and group takes it as it is; anything else loads ``dequantize()``."""

    method: str
    values: torch.Tensor
    scales: torch.Tensor
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.values.shape
        return n, k * 2 if self.method == "int4" else k

    def dequantize(self) -> torch.Tensor:
        if self.method == "int4":
            return dequantize_int4(self.values, self.scales, self.group)
        return dequantize_int8(self.values, self.scales, self.group)

    def rows(self, index: torch.Tensor | slice) -> "PackedWeight":
        return PackedWeight(self.method, self.values[index], self.scales[index], self.group)


def dense(tensor: "torch.Tensor | PackedWeight") -> torch.Tensor:
    """A checkpoint tensor as float values, whatever form it came in."""
    return tensor.dequantize() if isinstance(tensor, PackedWeight) else tensor
