"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 as one decoder, and their
mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE), whose MLPs are expert layers (moe.py).

The model knows tensors and attention metadata, never requests. ``forward`` takes the
flattened new tokens of a batch and returns their hidden states; ``compute_logits`` maps the
hidden states of the positions that get sampled to logits. What each layer keeps between steps
is declared by ``cache_specs`` (paged KV for every layer here). Device-specific work goes through
the ``ModelOps`` the platform chose (model/ops.py); the CPU platform's fused decode stack runs
this family's decode-only steps in one C call (platforms/cpu/fused_decode.py). Embedding,
lm_head and checkpoint loading are the shared ``CausalLM``'s (causal_lm.py).
"""

from __future__ import annotations

import torch
from torch import nn

from anna.model.attention import AttentionMetadata, PagedKV, paged_attention
from anna.model.cache_spec import AttentionSpec, CacheSpec
from anna.model.causal_lm import CausalLM
from anna.model.config import ModelConfig
from anna.model.layers import RMSNorm, RopeBatch, RotaryEmbedding
from anna.model.linear import make_linear
from anna.model.moe import decoder_mlp
from anna.model.ops import TORCH_OPS, ModelOps



class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: ModelOps) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = make_linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.attention_bias, dtype=dtype,
                               ops=ops)
        self.o_proj = make_linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias, dtype=dtype, ops=ops)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.sliding_window = cfg.sliding_window
        self.split = [q_size, kv_size, kv_size]
        self.ops = ops

    def forward(self, rope: RopeBatch, x: torch.Tensor, kv_cache: PagedKV, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.split, dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        q, k = self.ops.rotary(q, k, rope, self.num_heads, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        with self.ops.region("attention"):
            out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                                  self.ops)
        return self.o_proj(out.view(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: ModelOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = Attention(cfg, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp = decoder_mlp(cfg, index, dtype, ops)

    def forward(self, rope: RopeBatch, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: PagedKV,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual`` is the running sum of the stream; ``hidden`` the previous block's output."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 ops: ModelOps = TORCH_OPS, activation_dtype: torch.dtype | None = None) -> None:
        super().__init__(cfg, dtype, ops, activation_dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, torch.float32)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, ops) for i in range(cfg.num_hidden_layers))

    def cache_specs(self, dtype: torch.dtype) -> list[CacheSpec]:
        """What each layer keeps between steps: paged attention KV, in ``dtype``."""
        cfg = self.config
        spec = AttentionSpec(cfg.num_key_value_heads, cfg.head_dim, dtype, cfg.sliding_window)
        return [spec] * cfg.num_hidden_layers
