"""Which Hugging Face architectures Anna runs, and what distinguishes each one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Qwen2-MoE unless its qkv_bias is false)
    qk_norm: bool = False  # RMSNorm on each head of q and k before rotary (Qwen3)
    sliding_window_key: str | None = None  # config key of a sliding window applied to every layer
    moe: bool = False  # MLPs are mixtures of experts (model/moe.py)
    # (Anna's name fragment, the checkpoint's) for checkpoints that name modules differently
    checkpoint_names: tuple[tuple[str, str], ...] = ()


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(sliding_window_key="sliding_window"),
    "Qwen2ForCausalLM": Family(qkv_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    "MixtralForCausalLM": Family(sliding_window_key="sliding_window", moe=True,
                                 checkpoint_names=((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."),
                                                   (".up_proj.", ".w3."), (".down_proj.", ".w2."))),
    "Qwen2MoeForCausalLM": Family(qkv_bias=True, moe=True),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, moe=True),
}
