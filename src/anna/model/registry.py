"""Which Hugging Face architectures Anna runs, and what distinguishes each one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    qkv_bias: bool = False  # q/k/v projections always carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before rotary (Qwen3)
    sliding_window_key: str | None = None  # config key of a sliding window applied to every layer


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(sliding_window_key="sliding_window"),
    "Qwen2ForCausalLM": Family(qkv_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm=True),
}
