"""Mixture-of-experts MLP: a router picks each token's top-k experts, which are small gated MLPs.

Tokens are grouped by expert (one sort of the batch's choices and one read-back of the counts
per layer), and each expert that was chosen runs once over its tokens, so a step reads only the
weights of the experts it uses: at decode that is what bounds the speed. The experts are the
dense model's GatedMLP, so quantization and Anna's CPU kernels serve them as any other layer;
the router stays unquantized (a few rows that decide everything downstream). Quantized experts
on CPU go further: all chosen experts' gate_up matmuls run in one kernel call, then all their
down matmuls in another (anna_qgemm_experts), rather than a dozen small calls per expert.

Reading the counts back to the host is what keeps this layer out of captured graphs (the
decode executor runs eager for these models).
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn

from anna.model.config import MoeConfig
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
        if self._packed_kernel_serves(x, max(counts)):
            y = self._experts_packed(rows, counts)
        else:
            y = torch.empty_like(rows)
            start = 0
            for expert, count in zip(self.experts, counts):
                if count:
                    y[start:start + count] = expert(rows[start:start + count])
                start += count
        y = y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))

    def _packed_kernel_serves(self, x: torch.Tensor, most_rows: int) -> bool:
        """Quantized experts that the packed CPU kernel serves at this many rows run in one call per
        projection (anna_qgemm_experts) instead of one per expert."""
        first = self.experts[0]
        return (x.device.type == "cpu" and isinstance(first.gate_up_proj, QuantLinear)
                and first.gate_up_proj.bias is None and first.gate_up_proj.uses_packed_kernel(most_rows)
                and first.down_proj.uses_packed_kernel(most_rows))

    def _experts_packed(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        active = [e for e, count in enumerate(counts) if count]
        ids = torch.tensor(active, dtype=torch.long)
        starts = torch.tensor([0, *accumulate(counts[e] for e in active)], dtype=torch.long)
        gate_up_tables, down_tables = self._pointer_tables()
        gate_up, down = self.experts[0].gate_up_proj, self.experts[0].down_proj
        cpu = gate_up.policy.cpu
        with profiled(gate_up.policy, "matmul:experts_packed"):
            h = cpu.qgemm_experts(rows, *gate_up_tables, ids, starts, gate_up.kind, gate_up.group,
                                  gate_up.out_features)
            h = cpu.silu_mul(h)
            return cpu.qgemm_experts(h, *down_tables, ids, starts, down.kind, down.group, down.out_features)

    def _pointer_tables(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """Every expert's (qweight, scales) data pointers per projection, built once (rebuilt if the
        weights moved, e.g. onto huge pages)."""
        key = self.experts[0].gate_up_proj.qweight.data_ptr()
        if self._tables is None or self._tables[0] != key:
            def table(name: str) -> tuple[torch.Tensor, torch.Tensor]:
                layers = [getattr(expert, name) for expert in self.experts]
                return (torch.tensor([lin.qweight.data_ptr() for lin in layers], dtype=torch.int64),
                        torch.tensor([lin.scales.data_ptr() for lin in layers], dtype=torch.int64))
            self._tables = (key, table("gate_up_proj"), table("down_proj"))
        return self._tables[1], self._tables[2]
