"""Linear layers and how their matmuls are executed.

On CPUs without native bf16/fp16 matrix instructions, torch runs half-precision GEMMs with a
slow generic kernel: fine for decode (M = 1-2 rows, bound by reading weights, where half the
bytes wins) but several times slower than fp32 for prefill. So half-precision weights are kept
as they are and, when a matmul has at least ``upcast_min_rows`` rows, upcast to fp32 for that
matmul (benchmarks/matmul_routing.py measures the crossover).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MatmulPolicy:
    """How Linear layers execute; one object shared by the whole model."""

    cpu_upcast_min_rows: int = 12  # 0 = never upcast


DEFAULT_POLICY = MatmulPolicy()


class Linear(nn.Module):
    """y = x W^T + b, where W may stack several checkpoint tensors along the output dim
    (q/k/v, gate/up) so that one matmul serves them all."""

    def __init__(self, in_features: int, out_features: int | list[int], *, bias: bool, dtype: torch.dtype,
                 policy: MatmulPolicy = DEFAULT_POLICY) -> None:
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
        w = self.weight
        rows = x.numel() // x.shape[-1]
        if (x.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16)
                and 0 < self.policy.cpu_upcast_min_rows <= rows):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), w.float(), bias).to(x.dtype)
        return F.linear(x, w, self.bias)
