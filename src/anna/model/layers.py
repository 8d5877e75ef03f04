"""Layers shared by every decoder family: RMSNorm, rotary embedding, the gated MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from anna.model.linear import make_linear
from anna.model.ops import TORCH_OPS, ModelOps


class RMSNorm(nn.Module):
    weight_offset = 0.0  # added to the checkpoint's weight at load time

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual stream: residual += x, return (norm(residual), residual)."""
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5 / Qwen3-Next's norm: the checkpoint holds w and the output is norm(x) * (1 + w). The
    weight is stored as 1 + w in fp32 (in bf16, 1 + w would round small w to steps of 1/128)."""

    weight_offset = 1.0

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__(dim, eps, torch.float32, ops)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with the scaling types Anna supports."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type '{kind}' is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # the angles in fp32, as transformers computes them; their cos and sin in fp64, rounded once:
        # torch's fp32 cos of angles in the hundreds of radians came out 1.5e-4 off in some
        # processes on an AVX-512 host (a vector path chosen at run time), enough to move logits
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).double()
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def batch(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeBatch":
        """Looked up once per forward, used by every layer."""
        return RopeBatch(positions, self.cos, self.sin, self.cos[positions].unsqueeze(-2).to(dtype),
                         self.sin[positions].unsqueeze(-2).to(dtype))


@dataclass
class RopeBatch:
    positions: torch.Tensor  # [T] long
    cos_table: torch.Tensor  # [max_positions, D/2] fp32, for the CPU kernel
    sin_table: torch.Tensor
    cos: torch.Tensor  # [T, 1, D/2] in the activation dtype, for the torch path
    sin: torch.Tensor


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str, dtype: torch.dtype,
                 ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act '{act}' is not supported (supported: silu)")
        self.gate_up_proj = make_linear(hidden, [intermediate, intermediate], bias=bias, dtype=dtype, ops=ops)
        self.down_proj = make_linear(intermediate, hidden, bias=bias, dtype=dtype, ops=ops)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_mlp(self, x)
