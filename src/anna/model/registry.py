"""Which Hugging Face architectures Anna runs: architecture -> the model class that runs it and
the family flags that distinguish it. One file per family under model/ (llama.py: Llama,
Mistral, Qwen2, Qwen3 and their mixture-of-experts variants; qwen3_5.py: the hybrid Qwen3.5,
Qwen3.5-MoE and Qwen3-Next); adding an architecture is a model
file and an entry here. Classes are imported when asked for, so reading a config does not
import every model."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Qwen2-MoE unless its qkv_bias is false)
    qk_norm: bool = False  # RMSNorm on each head of q and k before rotary (Qwen3)
    sliding_window_key: str | None = None  # config key of a sliding window applied to every layer
    moe: bool = False  # MLPs are mixtures of experts (model/moe.py)
    moe_always_renormalizes: bool = False  # top-k routing weights sum to 1 whatever norm_topk_prob says
    hybrid: bool = False  # Gated DeltaNet layers beside full attention (model/qwen3_5.py)
    fused_linear_projections: bool = False  # Qwen3-Next: in_proj_qkvz / in_proj_ba, interleaved per key head
    checkpoint_prefix: str = "model."  # where the text model's tensors are (VL wrappers: model.language_model.)
    # (Anna's name fragment, the checkpoint's) for checkpoints that name modules differently
    checkpoint_names: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Architecture:
    module: str  # under anna.model
    class_name: str
    family: Family = field(default_factory=Family)


_QWEN3_5 = Family(qk_norm=True, hybrid=True)
_QWEN3_5_VL = Family(qk_norm=True, hybrid=True, checkpoint_prefix="model.language_model.")
_QWEN3_5_MOE = Family(qk_norm=True, hybrid=True, moe=True, moe_always_renormalizes=True)
_QWEN3_5_MOE_VL = Family(qk_norm=True, hybrid=True, moe=True, moe_always_renormalizes=True,
                         checkpoint_prefix="model.language_model.")

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": Architecture("llama", "LlamaForCausalLM", Family(sliding_window_key="sliding_window")),
    "Qwen2ForCausalLM": Architecture("llama", "LlamaForCausalLM", Family(qkv_bias=True)),
    "Qwen3ForCausalLM": Architecture("llama", "LlamaForCausalLM", Family(qk_norm=True)),
    "MixtralForCausalLM": Architecture("llama", "LlamaForCausalLM", Family(
        sliding_window_key="sliding_window", moe=True,
        checkpoint_names=((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                          (".down_proj.", ".w2.")))),
    "Qwen2MoeForCausalLM": Architecture("llama", "LlamaForCausalLM", Family(qkv_bias=True, moe=True)),
    "Qwen3MoeForCausalLM": Architecture("llama", "LlamaForCausalLM", Family(qk_norm=True, moe=True)),
    # hybrid: Gated DeltaNet linear attention, every fourth layer gated full attention (model/qwen3_5.py)
    "Qwen3_5ForCausalLM": Architecture("qwen3_5", "Qwen3_5ForCausalLM", _QWEN3_5),
    "Qwen3_5ForConditionalGeneration": Architecture("qwen3_5", "Qwen3_5ForCausalLM", _QWEN3_5_VL),
    "Qwen3_5MoeForCausalLM": Architecture("qwen3_5", "Qwen3_5ForCausalLM", _QWEN3_5_MOE),
    "Qwen3_5MoeForConditionalGeneration": Architecture("qwen3_5", "Qwen3_5ForCausalLM", _QWEN3_5_MOE_VL),
    "Qwen3NextForCausalLM": Architecture("qwen3_5", "Qwen3_5ForCausalLM", Family(
        qk_norm=True, moe=True, hybrid=True, fused_linear_projections=True)),
}


def model_class(architecture: str) -> type:
    """The class that runs ``architecture`` (a key of ARCHITECTURES)."""
    entry = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"anna.model.{entry.module}"), entry.class_name)
