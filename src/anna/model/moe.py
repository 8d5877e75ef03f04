"""Mixture-of-experts MLP: a router picks each token's top-k experts, which are small gated MLPs.

Tokens are grouped by expert (one sort of the batch's choices and one read-back of the counts
per layer), and each expert that was chosen runs once over its tokens, so a step reads only the
weights of the experts it uses: at decode that is what bounds the speed. The experts are the
dense model's GatedMLP, so quantization and Anna's CPU kernels serve them as any other layer;
the router stays unquantized (a few rows that decide everything downstream). Where Anna's CPU
kernels serve the experts, all chosen experts' gate_up matmuls run in one kernel call, then all
their down matmuls in another (anna_qgemm_experts / anna_gemv_experts), rather than a few small
calls per expert.

Reading the counts back to the host is what keeps this layer out of captured graphs (the
decode executor runs eager for these models).
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from anna.model.config import MoeConfig
from anna.model.cpu_kernels import WEIGHT_TYPES
from anna.model.layers import GatedMLP
from anna.model.linear import DEFAULT_POLICY, KernelPolicy, Linear, QuantLinear, profiled


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, moe: MoeConfig, bias: bool, act: str, dtype: torch.dtype,
                 policy: KernelPolicy = DEFAULT_POLICY) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Linear(hidden, moe.num_experts, bias=False, dtype=dtype, policy=policy)
        self.experts = nn.ModuleList(GatedMLP(hidden, moe.intermediate_size, bias, act, dtype, policy)
                                     for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden, moe.shared_expert_intermediate_size, bias, act, dtype, policy)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype, policy=policy)
        self._tables: tuple | None = None  # see _pointer_tables

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, top_k] and their weights (fp32), as transformers computes them:
        a softmax over all experts in fp32, the top k, optionally rescaled to sum to 1."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = self.run_experts(x, experts, weights)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    @torch.compiler.disable
    def run_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over each token's experts of weight * expert(token). Left to eager under
        torch.compile: traced, the counts read back would become constants and every step with
        another routing would compile again."""
        choices = experts.flatten()
        order = choices.argsort(stable=True)  # the (token, k) choices grouped by expert
        counts = torch.bincount(choices, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        rows = x[tokens]  # each choice's input, grouped by expert
        if self._grouped_kernels_serve(x, max(counts)):
            y = self._experts_grouped(rows, counts)
        else:
            y = torch.empty_like(rows)
            start = 0
            for expert, count in zip(self.experts, counts):
                if count:
                    y[start:start + count] = expert(rows[start:start + count])
                start += count
        y = y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))

    def _grouped_kernels_serve(self, x: torch.Tensor, most_rows: int) -> bool:
        """Where Anna's CPU kernels would serve every expert's matmuls (the packed quantized kernel,
        or the weight-streaming one), all experts run in one call per projection instead."""
        gate_up, down = self.experts[0].gate_up_proj, self.experts[0].down_proj
        if x.device.type != "cpu" or gate_up.bias is not None:
            return False
        if isinstance(gate_up, QuantLinear):
            return gate_up.uses_packed_kernel(most_rows) and down.uses_packed_kernel(most_rows)
        return gate_up.uses_gemv_kernel(most_rows) and down.uses_gemv_kernel(most_rows)

    def _experts_grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        active = [e for e, count in enumerate(counts) if count]
        ids = torch.tensor(active, dtype=torch.long)
        starts = torch.tensor([0, *accumulate(counts[e] for e in active)], dtype=torch.long)
        gate_up_tables, down_tables = self._pointer_tables()
        gate_up, down = self.experts[0].gate_up_proj, self.experts[0].down_proj
        with profiled(gate_up.policy, "matmul:experts_grouped"):
            h = _grouped_matmul(gate_up, gate_up_tables, rows, ids, starts)
            return _grouped_matmul(down, down_tables, gate_up.policy.cpu.silu_mul(h), ids, starts)

    def _pointer_tables(self) -> tuple[PointerTable, PointerTable]:
        """Every expert's weight data pointers per projection, built once (rebuilt if the weights
        moved, e.g. onto huge pages)."""
        key = _weight_tensors(self.experts[0].gate_up_proj)[0].data_ptr()
        if self._tables is None or self._tables[0] != key:
            def table(name: str) -> PointerTable:
                per_expert = [_weight_tensors(getattr(expert, name)) for expert in self.experts]
                return tuple(torch.tensor([tensors[i].data_ptr() for tensors in per_expert], dtype=torch.int64)
                             for i in range(len(per_expert[0])))
            self._tables = (key, table("gate_up_proj"), table("down_proj"))
        return self._tables[1], self._tables[2]


PointerTable = tuple[torch.Tensor, ...]  # int64 data pointers of every expert: (weights,) or (qweights, scales)


def _weight_tensors(linear: Linear | QuantLinear) -> tuple[torch.Tensor, ...]:
    return (linear.qweight, linear.scales) if isinstance(linear, QuantLinear) else (linear.weight,)


def _grouped_matmul(linear: Linear | QuantLinear, table: PointerTable, x: torch.Tensor, ids: torch.Tensor,
                    starts: torch.Tensor) -> torch.Tensor:
    """The experts' matmuls of one projection (``linear`` is any expert's: they share shape and format)."""
    cpu = linear.policy.cpu
    if isinstance(linear, QuantLinear):
        return cpu.qgemm_experts(x, *table, ids, starts, linear.kind, linear.group, linear.out_features)
    return cpu.gemv_experts(x, *table, ids, starts, WEIGHT_TYPES[linear.weight.dtype], linear.out_features)
