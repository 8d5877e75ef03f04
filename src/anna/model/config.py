"""The parts of a Hugging Face config.json that the model code needs, in one typed object.

Both config forms are read: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters`` holding the theta and the scaling together). Vision-language wrappers
(Qwen3.5's ``*ForConditionalGeneration``) nest the text model's config in ``text_config``; its
fields are read as if they were at the top level.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the problem."""


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    attention_bias: bool = False  # bias on q/k/v (and o for Llama/Qwen3 style attention_bias)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoeConfig | None = None  # a mixture-of-experts model
    linear_attention: LinearAttentionConfig | None = None  # a hybrid model (Gated DeltaNet + full attention)
    rotary_dim: int = 0  # dimensions of each head that rotary rotates (partial_rotary_factor); 0: all
    mtp_num_hidden_layers: int = 0  # the checkpoint's multi-token-prediction layers (Qwen3.5, Qwen3-Next)
    load_mtp: bool = False  # build and load them (speculative decoding's mtp method); not a checkpoint field
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim


@dataclass(frozen=True)
class MoeConfig:
    """The experts of a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each routed expert
    renormalize: bool  # the top-k routing weights are rescaled to sum to 1 (Mixtral; norm_topk_prob)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP (False)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)."""

    layer_types: tuple[str, ...]  # per layer: "linear_attention" or "full_attention"
    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each key head serves consecutive value heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # of the depthwise causal conv1d over q, k and v

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the conv: q, k and v
        return 2 * self.key_dim + self.value_dim


LAYER_TYPES = ("linear_attention", "full_attention")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


# generation_config.json keys that become default sampling parameters (as in vLLM), by SamplingParams name.
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(folder: str | Path) -> dict[str, Any]:
    """The model author's recommended sampling parameters from ``folder/generation_config.json``
    (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens); an
    empty dict if the file has none of them or does not exist."""
    path = Path(folder) / "generation_config.json"
    if not path.exists():
        return {}
    gen = _read_json(path)
    return {name: gen[key] for key, name in GENERATION_DEFAULT_KEYS.items() if gen.get(key) is not None}


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read config.json (and generation_config.json for EOS ids) from a model directory."""
    from anna.model.registry import ARCHITECTURES  # the registry says which features each family has

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory not found")
    path = model_dir / "config.json"
    cfg = _read_json(path)
    if isinstance(cfg.get("text_config"), dict):  # a vision-language wrapper: serve its text model
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"],
               "architectures": cfg.get("architectures")}
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: unsupported architectures {archs or '(none given)'}; "
            f"Anna supports {', '.join(sorted(ARCHITECTURES))}")
    family = ARCHITECTURES[arch].family

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelLoadError(f"{path}: missing required field '{key}'")
        return cfg[key]

    rope = cfg.get("rope_parameters")
    partial_rotary = float(cfg.get("partial_rotary_factor", 1.0))
    if isinstance(rope, dict):  # transformers 5.x form
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial_rotary = float(rope.get("partial_rotary_factor", partial_rotary))
        # (mrope_section / mrope_interleaved: with text positions MRoPE is plain RoPE)
        rope_scaling = {k: v for k, v in rope.items()
                        if k not in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    else:
        rope_theta = float(cfg.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        rope_scaling = dict(rope_scaling, rope_type=rope_type)
        if rope_type == "default":
            rope_scaling = None

    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    head_dim = cfg.get("head_dim") or hidden // num_heads
    sliding_window = None
    if family.sliding_window_key and cfg.get(family.sliding_window_key):
        sliding_window = int(cfg[family.sliding_window_key])
    elif cfg.get("use_sliding_window"):
        raise ModelLoadError(f"{path}: use_sliding_window=true is not supported for {arch}")
    if model_dir.joinpath("generation_config.json").exists():
        gen = _read_json(model_dir / "generation_config.json")
    else:
        gen = {}
    eos = _as_id_list(gen.get("eos_token_id", cfg.get("eos_token_id")))
    attention_bias = bool(cfg.get("attention_bias", False))
    num_layers = int(need("num_hidden_layers"))
    intermediate = int(need("intermediate_size"))
    moe = _moe_config(cfg, num_layers, intermediate, path, family.moe_always_renormalizes) if family.moe else None
    linear = _linear_attention_config(cfg, num_layers, path) if family.hybrid else None
    rotary_dim = int(int(head_dim) * partial_rotary) if partial_rotary != 1.0 else 0
    if rotary_dim % 2 or rotary_dim < 0 or rotary_dim > int(head_dim):
        raise ModelLoadError(f"{path}: partial_rotary_factor={partial_rotary} gives {rotary_dim} rotary dimensions "
                             f"of head_dim {head_dim} (need an even number from 2 to head_dim)")
    return ModelConfig(
        architecture=arch,
        model_type=str(cfg.get("model_type", "")),
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        attention_bias=(family.qkv_bias and bool(cfg.get("qkv_bias", True))) or attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        sliding_window=sliding_window,
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        moe=moe,
        linear_attention=linear,
        rotary_dim=rotary_dim,
        mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers", 0) or 0) if family.hybrid else 0,
        raw=cfg,
    )


def _linear_attention_config(cfg: dict[str, Any], num_layers: int, path: Path) -> LinearAttentionConfig:
    """Which layers are Gated DeltaNet (``layer_types``; without it every
    ``full_attention_interval``-th layer, by default the fourth, is full attention) and their shapes."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{path}: layer_types must list {num_layers} entries, each one of {', '.join(LAYER_TYPES)}")
    try:
        linear = LinearAttentionConfig(
            layer_types=tuple(types), num_key_heads=int(cfg["linear_num_key_heads"]),
            num_value_heads=int(cfg["linear_num_value_heads"]), key_head_dim=int(cfg["linear_key_head_dim"]),
            value_head_dim=int(cfg["linear_value_head_dim"]), conv_kernel=int(cfg["linear_conv_kernel_dim"]))
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing required field {exc.args[0]!r} of the linear-attention layers") from None
    if linear.num_key_heads < 1 or linear.num_value_heads % linear.num_key_heads or linear.conv_kernel < 1:
        raise ModelLoadError(f"{path}: linear_num_value_heads ({linear.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({linear.num_key_heads}), and linear_conv_kernel_dim >= 1")
    return linear


def _moe_config(cfg: dict[str, Any], num_layers: int, intermediate: int, path: Path,
                always_renormalizes: bool = False) -> MoeConfig:
    """The expert count is ``num_experts`` (Qwen) or ``num_local_experts`` (Mixtral, and what
    transformers 5 writes for all). Which layers have experts follows transformers: every
    ``decoder_sparse_step``-th layer that ``mlp_only_layers`` does not list."""
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ModelLoadError(f"{path}: {num_experts} experts with num_experts_per_tok={top_k} is not a mixture of "
                             "experts (need 1 <= num_experts_per_tok <= num_experts)")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return MoeConfig(
        num_experts=num_experts, top_k=top_k,
        intermediate_size=int(cfg.get("moe_intermediate_size") or intermediate),
        # (Mixtral has no such key and always renormalizes; so does Qwen3.5-MoE, whatever its config says)
        renormalize=always_renormalizes or bool(cfg.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)))
