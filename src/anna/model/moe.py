"""Mixture-of-experts MLP: a router picks each token's top-k experts, which are small gated MLPs.

Tokens are grouped by expert (one sort of the batch's choices and one read-back of the counts
per layer), and each expert that was chosen runs once over its tokens, so a step reads only the
weights of the experts it uses: at decode that is what bounds the speed. The experts are the
dense model's GatedMLP, so quantization and Anna's CPU kernels serve them as any other layer;
the router stays unquantized (a few rows that decide everything downstream). Where Anna's CPU
kernels serve the experts, all chosen experts' gate_up matmuls run in one kernel call, then all
their down matmuls in another (the CPU ops' ``grouped_experts``), rather than a few small calls
per expert.

Reading the counts back to the host is what keeps this layer out of captured graphs (the
decode executor runs eager for these models).
"""

from __future__ import annotations

import torch
from torch import nn

from anna.model.config import ModelConfig, MoeConfig
from anna.model.layers import GatedMLP
from anna.model.linear import Linear
from anna.model.ops import TORCH_OPS, ModelOps


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, moe: MoeConfig, bias: bool, act: str, dtype: torch.dtype,
                 ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Linear(hidden, moe.num_experts, bias=False, dtype=dtype, ops=ops)
        self.experts = nn.ModuleList(GatedMLP(hidden, moe.intermediate_size, bias, act, dtype, ops)
                                     for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden, moe.shared_expert_intermediate_size, bias, act, dtype, ops)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype, ops=ops)
        self.ops = ops
        self.kernel_tables: tuple | None = None  # the grouped kernels' pointer tables, kept by the ops

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

    # Left to eager under torch.compile (runtime/compilation.py): traced, the counts read back
    # would become constants and every step with another routing would compile again.
    eager_under_compile = ("run_experts",)

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over each token's experts of weight * expert(token)."""
        choices = experts.flatten()
        order = choices.argsort(stable=True)  # the (token, k) choices grouped by expert
        counts = torch.bincount(choices, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        rows = x[tokens]  # each choice's input, grouped by expert
        y = self.ops.grouped_experts(self, rows, counts)
        if y is None:
            y = torch.empty_like(rows)
            start = 0
            for expert, count in zip(self.experts, counts):
                if count:
                    y[start:start + count] = expert(rows[start:start + count])
                start += count
        y = y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def decoder_mlp(cfg: ModelConfig, index: int, dtype: torch.dtype, ops: ModelOps = TORCH_OPS) -> GatedMLP | SparseMoE:
    """Layer ``index``'s MLP: experts where the config makes it sparse, else the dense gated MLP."""
    if cfg.moe is not None and cfg.moe.sparse_layers[index]:
        return SparseMoE(cfg.hidden_size, cfg.moe, cfg.mlp_bias, cfg.hidden_act, dtype, ops)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, dtype, ops)
