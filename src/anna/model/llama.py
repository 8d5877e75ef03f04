"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 as one decoder.

The model knows tensors and attention metadata, never requests. ``forward`` takes the
flattened new tokens of a batch and returns their hidden states; ``compute_logits`` maps the
hidden states of the positions that get sampled to logits.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from anna.model.attention import AttentionMetadata, paged_attention
from anna.model.config import ModelConfig
from anna.model.layers import GatedMLP, RMSNorm, RopeBatch, RotaryEmbedding, apply_rotary
from anna.model.linear import DEFAULT_POLICY, KernelPolicy, Linear

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, policy: KernelPolicy) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.attention_bias, dtype=dtype,
                               policy=policy)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias, dtype=dtype, policy=policy)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, policy) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, policy) if cfg.qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.sliding_window = cfg.sliding_window
        self.split = [q_size, kv_size, kv_size]
        self.policy = policy

    def forward(self, rope: RopeBatch, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.split, dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        cpu = self.policy.cpu
        if cpu is not None and qkv.dtype == torch.float32 and qkv.device.type == "cpu":
            cpu.rotary(q, self.num_heads, self.head_dim, rope.cos_table, rope.sin_table, rope.positions)
            cpu.rotary(k, self.num_kv_heads, self.head_dim, rope.cos_table, rope.sin_table, rope.positions)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
        else:
            q = apply_rotary(q.view(t, self.num_heads, self.head_dim), rope.cos, rope.sin)
            k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), rope.cos, rope.sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window, cpu)
        return self.o_proj(out.view(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, policy: KernelPolicy) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, policy)
        self.self_attn = Attention(cfg, dtype, policy)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, policy)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, dtype, policy)

    def forward(self, rope: RopeBatch, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual`` is the running sum of the stream; ``hidden`` the previous block's output."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# Checkpoint name fragment -> (fused parameter name, shard index)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 policy: KernelPolicy = DEFAULT_POLICY, activation_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.activation_dtype = activation_dtype or dtype
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, torch.float32)
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, policy) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, policy)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, policy=policy)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens[input_ids].to(self.activation_dtype)  # a fresh tensor: the stream may mutate it
        rope = self.rotary.batch(positions, hidden.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv, meta)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- weights ----
    def checkpoint_targets(self) -> dict[str, tuple[nn.Parameter, Linear | None, int]]:
        """Map every checkpoint tensor name this model needs to (parameter, fused Linear, shard index)."""
        targets: dict[str, tuple[nn.Parameter, Linear | None, int]] = {}
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        for name, param in params.items():
            ckpt = _checkpoint_name(name)
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            module_name, _, kind = name.rpartition(".")
            module = modules.get(module_name)
            if isinstance(module, Linear) and len(module.shard_sizes) > 1:
                for fragment, (fused, shard) in STACKED_PARAMS.items():
                    if fused in "." + name:
                        targets[ckpt.replace(fused, fragment)] = (param, module, shard)
            else:
                targets[ckpt] = (param, module if isinstance(module, Linear) else None, 0)
        return targets

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """Copy checkpoint tensors into the parameters; return the checkpoint names consumed."""
        targets = self.checkpoint_targets()
        loaded = set()
        for name, tensor in tensors:
            if name not in targets:
                continue  # e.g. rotary inv_freq buffers, a tied lm_head
            param, linear, shard = targets[name]
            dest = param.data
            if linear is not None and len(linear.shard_sizes) > 1:
                dest = dest[linear.shard_slice(shard)]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise_shape_mismatch(name, where, tuple(dest.shape), tuple(tensor.shape))
            dest.copy_(tensor)
            loaded.add(name)
        return loaded


def raise_shape_mismatch(name: str, where: str, expected: tuple, got: tuple) -> None:
    from anna.model.config import ModelLoadError
    raise ModelLoadError(f"{where}: tensor '{name}' has shape {list(got)}, but config.json implies {list(expected)}")


def _checkpoint_name(param_name: str) -> str:
    if param_name == "embed_tokens":
        return "model.embed_tokens.weight"
    if param_name.startswith("lm_head."):
        return param_name
    return "model." + param_name
