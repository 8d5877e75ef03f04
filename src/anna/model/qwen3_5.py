"""The hybrid Qwen family: Qwen3.5, Qwen3.5-MoE and Qwen3-Next as one decoder.

Layers alternate by ``layer_types``: Gated DeltaNet linear attention (gated_delta.py; a fixed-size
state per sequence) and, by default every fourth layer, full attention over the paged KV whose
query projection also carries a per-head output gate (sigmoid), with per-head q/k norms and
rotary on the first ``partial_rotary_factor`` of each head (MRoPE is plain RoPE for text). Every
norm is zero-centred (the checkpoint holds w, the output is norm(x) * (1 + w)). MLPs are dense or
experts with a sigmoid-gated shared expert (moe.py).

Checkpoints: the text-only ``*ForCausalLM`` files name tensors ``model.*``; the vision-language
``*ForConditionalGeneration`` ones ``model.language_model.*``, beside a vision tower
(``model.visual.*``, not loaded: images are not served) and, in both, the multi-token-prediction
head (``mtp.*``, mtp.py: loaded only for speculative decoding's mtp method). Qwen3-Next fuses q/k/v/z and b/a into two projections, grouped per
key head; they are split into Qwen3.5's order at load time, so one forward serves all three.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from anna.model.attention import AttentionMetadata, PagedKV, paged_attention
from anna.model.cache_spec import AttentionSpec, CacheSpec
from anna.model.causal_lm import STACKED_PARAMS, CausalLM, Loader
from anna.model.config import LinearAttentionConfig, ModelConfig
from anna.model.gated_delta import GatedDeltaNet, state_spec
from anna.model.layers import RopeBatch, RotaryEmbedding, ZeroCenteredRMSNorm
from anna.model.linear import Linear, QuantLinear, check_shape, make_linear
from anna.model.moe import decoder_mlp
from anna.model.mtp import MultiTokenPredictor
from anna.model.ops import TORCH_OPS, ModelOps, apply_rotary



class GatedAttention(nn.Module):
    """Full attention whose output is scaled by sigmoid(gate), the gate a second half of each
    query head's projection ([query | gate] per head in q_proj's rows)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: ModelOps) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [2 * q_size, kv_size, kv_size]
        self.qkv_proj = make_linear(cfg.hidden_size, self.split, bias=cfg.attention_bias, dtype=dtype, ops=ops)
        self.o_proj = make_linear(q_size, cfg.hidden_size, bias=cfg.attention_bias, dtype=dtype, ops=ops)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops)
        self.rope_dim = cfg.rope_dim
        self.scale = self.head_dim ** -0.5
        self.ops = ops

    def forward(self, rope: RopeBatch, x: torch.Tensor, kv_cache: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        q = self.q_norm(q_gate[..., :d].contiguous())
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        q, k = self._rotate(q, k, rope)
        v = v.view(t, self.num_kv_heads, d)
        with self.ops.region("attention"):
            out = paged_attention(q, k, v, kv_cache, meta, self.scale, None, self.ops)
        out = out * torch.sigmoid(q_gate[..., d:])
        return self.o_proj(out.reshape(t, -1))

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rope: RopeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        t, rd = q.shape[0], self.rope_dim
        if rd == self.head_dim:
            return self.ops.rotary(q.view(t, -1), k.reshape(t, -1), rope, self.num_heads, self.num_kv_heads, rd)
        with self.ops.region("rotary"):  # partial rotary: the first rd dimensions of each head
            return tuple(torch.cat([apply_rotary(x[..., :rd], rope.cos, rope.sin), x[..., rd:]], dim=-1)
                         for x in (q, k))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, activation_dtype: torch.dtype,
                 ops: ModelOps) -> None:
        super().__init__()
        lin = cfg.linear_attention
        self.is_linear = lin.layer_types[index] == "linear_attention"
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, lin, cfg.rms_norm_eps, dtype, activation_dtype, ops)
        else:
            self.self_attn = GatedAttention(cfg, dtype, ops)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp = decoder_mlp(cfg, index, dtype, ops)

    def forward(self, rope: RopeBatch, hidden: torch.Tensor, residual: torch.Tensor | None, cache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, cache, meta)
        else:
            hidden = self.self_attn(rope, hidden, cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5ForCausalLM(CausalLM):
    final_norm = ZeroCenteredRMSNorm
    stacked_params = {**STACKED_PARAMS, ".in_proj_qkv.": (".in_proj.", 0), ".in_proj_z.": (".in_proj.", 1),
                      ".in_proj_b.": (".in_proj_ba.", 0), ".in_proj_a.": (".in_proj_ba.", 1)}
    SKIPPED_PREFIXES = {"model.visual.": "the vision tower (Anna serves text; images are not served)",
                        "mtp.": "the multi-token-prediction head (loaded for speculative decoding's mtp method)"}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 ops: ModelOps = TORCH_OPS, activation_dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, dtype, ops, activation_dtype)
        self.rotary = RotaryEmbedding(cfg.rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, torch.float32)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, dtype, self.activation_dtype, ops)
                                    for i in range(cfg.num_hidden_layers))
        # the multi-token-prediction head, only where speculative decoding's mtp method asks for it
        self.mtp = MultiTokenPredictor(cfg, dtype, self.activation_dtype, ops) \
            if cfg.load_mtp and cfg.mtp_num_hidden_layers else None

    def cache_specs(self, dtype: torch.dtype) -> list[CacheSpec]:
        """Paged KV (in ``dtype``) for the full-attention layers; for the linear-attention layers a
        state per sequence: the conv's last inputs in ``dtype``, the recurrent memory in fp32."""
        cfg = self.config
        attention = AttentionSpec(cfg.num_key_value_heads, cfg.head_dim, dtype)
        state = state_spec(cfg.linear_attention, dtype)
        return [state if layer.is_linear else attention for layer in self.layers]

    def checkpoint_targets(self) -> dict[str, Loader]:
        targets = super().checkpoint_targets()
        if not self.family.fused_linear_projections:
            return targets
        prefix = self.family.checkpoint_prefix
        for i, layer in enumerate(self.layers):
            if layer.is_linear:
                base = f"{prefix}layers.{i}.linear_attn."
                for part in ("qkv", "z", "b", "a"):
                    del targets[f"{base}in_proj_{part}.weight"]
                proj, lin = layer.linear_attn.in_proj, self.config.linear_attention
                qkvz = partial(_load_grouped_qkvz, proj, lin)
                ba = partial(_load_grouped_ba, layer.linear_attn.in_proj_ba, lin)
                shard = layer.linear_attn.tensor_parallel
                if shard is not None:  # this rank's key heads' groups, then split as a whole model's
                    ratio = lin.num_value_heads // lin.num_key_heads
                    qkvz = partial(_key_head_rows, shard, 2 * lin.key_head_dim + 2 * ratio * lin.value_head_dim, qkvz)
                    ba = partial(_key_head_rows, shard, 2 * ratio, ba)
                targets[base + "in_proj_qkvz.weight"] = qkvz
                targets[base + "in_proj_ba.weight"] = ba
        return targets


def _key_head_rows(shard, rows_per_key_head: int, load: Loader, tensor: torch.Tensor, name: str, where: str) -> None:
    load(shard.key_head_rows(tensor, rows_per_key_head), name, where)


def _load_grouped_qkvz(proj: Linear | QuantLinear, lin: LinearAttentionConfig, tensor: torch.Tensor, name: str,
                       where: str) -> None:
    """Qwen3-Next's in_proj_qkvz: per key head [q | k | its value heads' v | their z]; loaded as
    in_proj's shards 0 (all q, all k, all v) and 1 (all z)."""
    groups, r = lin.num_key_heads, lin.num_value_heads // lin.num_key_heads
    dk, dv = lin.key_head_dim, lin.value_head_dim
    hidden = tensor.shape[-1]
    check_shape(name, where, (lin.conv_dim + lin.value_dim, hidden), tuple(tensor.shape))
    q, k, v, z = tensor.view(groups, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    qkv = torch.cat([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)])
    proj.load("weight", 0, qkv, name, where)
    proj.load("weight", 1, z.reshape(-1, hidden), name, where)


def _load_grouped_ba(proj: Linear | QuantLinear, lin: LinearAttentionConfig, tensor: torch.Tensor, name: str,
                     where: str) -> None:
    """Qwen3-Next's in_proj_ba: per key head [its value heads' b | their a]; as all b, then all a."""
    groups, r = lin.num_key_heads, lin.num_value_heads // lin.num_key_heads
    hidden = tensor.shape[-1]
    check_shape(name, where, (2 * lin.num_value_heads, hidden), tuple(tensor.shape))
    b, a = tensor.view(groups, 2 * r, hidden).split([r, r], dim=1)
    proj.load("weight", 0, b.reshape(-1, hidden), name, where)
    proj.load("weight", 1, a.reshape(-1, hidden), name, where)
