"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 as one decoder, and their
mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE), whose MLPs are expert layers (moe.py).

The model knows tensors and attention metadata, never requests. ``forward`` takes the
flattened new tokens of a batch and returns their hidden states; ``compute_logits`` maps the
hidden states of the positions that get sampled to logits. What each layer keeps between steps
is declared by ``cache_specs`` (paged KV for every layer here). Device-specific work goes through
the ``ModelOps`` the platform chose (model/ops.py); the CPU platform's fused decode stack runs
this family's decode-only steps in one C call (platforms/cpu/fused_decode.py).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn

from anna.model.attention import AttentionMetadata, paged_attention
from anna.model.cache_spec import AttentionSpec, CacheSpec
from anna.model.config import ModelConfig
from anna.model.layers import GatedMLP, RMSNorm, RopeBatch, RotaryEmbedding
from anna.model.linear import Linear, QuantLinear, check_shape, make_linear
from anna.model.moe import SparseMoE
from anna.model.ops import TORCH_OPS, ModelOps
from anna.model.registry import ARCHITECTURES

KVCache = tuple[torch.Tensor, torch.Tensor]


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

    def forward(self, rope: RopeBatch, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(self.split, dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, -1)
        q, k = self.ops.rotary(q, k, rope, self.num_heads, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        with self.ops.region("attention"):
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                  self.ops)
        return self.o_proj(out.view(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: ModelOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = Attention(cfg, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp: GatedMLP | SparseMoE
        if cfg.moe is not None and cfg.moe.sparse_layers[index]:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.mlp_bias, cfg.hidden_act, dtype, ops)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, dtype, ops)

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
                 ops: ModelOps = TORCH_OPS, activation_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.activation_dtype = activation_dtype or dtype
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, torch.float32)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, ops) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.lm_head = make_linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, ops=ops)
        self.lm_head.profile_name = "lm_head"
        if cfg.tie_word_embeddings and isinstance(self.lm_head, QuantLinear):
            # The quantized lm_head is the only copy: lookups dequantize the rows they need.
            self.register_parameter("embed_tokens", None)
        else:
            self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                             requires_grad=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A fresh tensor (the residual stream may be updated in place)."""
        if self.embed_tokens is None:
            return self.lm_head.dequantized(input_ids).to(self.activation_dtype)
        if self.config.tie_word_embeddings:  # the lm_head's weight, in the lm_head's layout
            return self.lm_head.weight_rows(input_ids).to(self.activation_dtype)
        return self.embed_tokens[input_ids].to(self.activation_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed(input_ids)
        rope = self.rotary.batch(positions, hidden.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv, meta)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def cache_specs(self, dtype: torch.dtype) -> list[CacheSpec]:
        """What each layer keeps between steps: paged attention KV, in ``dtype``."""
        cfg = self.config
        spec = AttentionSpec(cfg.num_key_value_heads, cfg.head_dim, dtype, cfg.sliding_window)
        return [spec] * cfg.num_hidden_layers

    # ---- weights ----
    def checkpoint_targets(self) -> dict[str, Callable[[torch.Tensor, str, str], None]]:
        """Every checkpoint tensor this model needs -> a function(tensor, name, where) that loads it."""
        targets: dict[str, Callable[[torch.Tensor, str, str], None]] = {}
        tied = self.config.tie_word_embeddings
        for mod_name, module in self.named_modules():
            if isinstance(module, (Linear, QuantLinear)):
                prefix = "lm_head" if mod_name == "lm_head" else "model." + mod_name
                for kind in ("weight", "bias"):
                    if kind == "bias" and module.bias is None:
                        continue
                    if len(module.shard_sizes) == 1:
                        names = [(f"{prefix}.{kind}", 0)]
                    else:
                        names = [(f"{prefix}.{kind}".replace(fused, fragment), shard)
                                 for fragment, (fused, shard) in STACKED_PARAMS.items() if fused in prefix + "."]
                    for ckpt, shard in names:
                        targets[self._checkpoint_name(ckpt)] = partial(_load_linear, module, kind, shard)
            elif isinstance(module, RMSNorm):
                targets[f"model.{mod_name}.weight"] = partial(_copy_into, module.weight)
        if self.embed_tokens is not None:
            targets["model.embed_tokens.weight"] = partial(_copy_into, self.embed_tokens)
        if tied:
            loader = targets.pop("lm_head.weight")
            if self.embed_tokens is None:  # quantized: the embedding checkpoint tensor feeds the lm_head
                targets["model.embed_tokens.weight"] = loader
        return targets

    def _checkpoint_name(self, name: str) -> str:
        """A tensor's name in the checkpoints of this family (e.g. Mixtral's block_sparse_moe.experts.N.w1)."""
        for ours, theirs in ARCHITECTURES[self.config.architecture].family.checkpoint_names:
            name = name.replace(ours, theirs)
        return name

    def interleave_for_cpu_kernels(self, converted: bool = False) -> None:
        """After loading: store the weights Anna's CPU kernel serves in the layout it reads
        (``converted``: they already are, read back from the int4 layout cache)."""
        for module in self.modules():
            if isinstance(module, (Linear, QuantLinear)):
                module.interleave_for_cpu_kernel(converted)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """Load checkpoint tensors (converting or quantizing them); return the names consumed."""
        targets = self.checkpoint_targets()
        loaded = set()
        for name, tensor in tensors:
            target = targets.get(name)
            if target is None:
                continue  # e.g. rotary inv_freq buffers, a tied lm_head
            target(tensor, name, where)
            loaded.add(name)
        return loaded


def _load_linear(module: Linear | QuantLinear, kind: str, shard: int, tensor: torch.Tensor, name: str,
                 where: str) -> None:
    module.load(kind, shard, tensor, name, where)


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str, where: str) -> None:
    check_shape(name, where, tuple(param.shape), tuple(tensor.shape))
    param.data.copy_(tensor)
