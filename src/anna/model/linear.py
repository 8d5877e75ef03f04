"""Linear layers and how their matmuls are executed, routed by M (rows of x).

On CPU, decode-sized matmuls (M <= ``cpu_gemv_max_rows``) go to Anna's weight-streaming kernel,
which reads each weight row once for all rows of x. Larger half-precision matmuls are upcast to
fp32: torch's bf16/fp16 GEMM on CPUs without native half-precision matrix instructions is
several times slower than its fp32 GEMM. benchmarks/matmul_routing.py measures the crossovers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from anna.model.cpu_kernels import CpuKernels


@dataclass
class KernelPolicy:
    """Which kernels the layers use; one object shared by the whole model."""

    cpu: CpuKernels | None = None  # Anna's CPU kernels, when they could be built
    cpu_gemv_max_rows: int = 32
    cpu_upcast_min_rows: int = 8  # without Anna's kernels: half-precision matmuls from this M on run in fp32


DEFAULT_POLICY = KernelPolicy()


class Linear(nn.Module):
    """y = x W^T + b, where W may stack several checkpoint tensors along the output dim
    (q/k/v, gate/up) so that one matmul serves them all."""

    def __init__(self, in_features: int, out_features: int | list[int], *, bias: bool, dtype: torch.dtype,
                 policy: KernelPolicy = DEFAULT_POLICY) -> None:
        super().__init__()
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        self.in_features = in_features
        self.out_features = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        self.policy = policy

    def shard_slice(self, shard: int) -> slice:
        start = sum(self.shard_sizes[:shard])
        return slice(start, start + self.shard_sizes[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, policy = self.weight, self.policy
        if x.device.type != "cpu":
            return F.linear(x, w, self.bias)
        rows = x.numel() // x.shape[-1]
        if policy.cpu is not None and rows <= policy.cpu_gemv_max_rows and policy.cpu.supports_weight(w):
            return policy.cpu.gemv(x, w, self.bias).to(x.dtype)
        if w.dtype == x.dtype:
            return F.linear(x, w, self.bias)
        if policy.cpu is not None or 0 < policy.cpu_upcast_min_rows <= rows:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), w.float(), bias).to(x.dtype)
        return F.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
