"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 as one decoder, and their
mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE), whose MLPs are expert layers (moe.py).

The model knows tensors and attention metadata, never requests. ``forward`` takes the
flattened new tokens of a batch and returns their hidden states; ``compute_logits`` maps the
hidden states of the positions that get sampled to logits.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn

from anna.model.attention import AttentionMetadata, paged_attention
from anna.model.config import ModelConfig
from anna.model.cpu_kernels import WEIGHT_TYPES, AnnaLayer, AnnaLinear
from anna.model.layers import GatedMLP, RMSNorm, RopeBatch, RotaryEmbedding, apply_rotary
from anna.model.linear import (DEFAULT_POLICY, KernelPolicy, Linear, QuantLinear, check_shape, make_linear,
                               profiled)
from anna.model.moe import SparseMoE
from anna.model.registry import ARCHITECTURES

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, policy: KernelPolicy) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = make_linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.attention_bias, dtype=dtype,
                               policy=policy)
        self.o_proj = make_linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias, dtype=dtype, policy=policy)
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
        with profiled(self.policy, "rotary"):
            if cpu is not None and qkv.dtype == torch.float32 and qkv.device.type == "cpu":
                cpu.rotary(q, self.num_heads, self.head_dim, rope.cos_table, rope.sin_table, rope.positions)
                cpu.rotary(k, self.num_kv_heads, self.head_dim, rope.cos_table, rope.sin_table, rope.positions)
                q = q.view(t, self.num_heads, self.head_dim)
                k = k.view(t, self.num_kv_heads, self.head_dim)
            else:
                q = apply_rotary(q.view(t, self.num_heads, self.head_dim), rope.cos, rope.sin)
                k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), rope.cos, rope.sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        with profiled(self.policy, "attention"):
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window, cpu)
        return self.o_proj(out.view(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, policy: KernelPolicy) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, policy)
        self.self_attn = Attention(cfg, dtype, policy)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, policy)
        self.mlp: GatedMLP | SparseMoE
        if cfg.moe is not None and cfg.moe.sparse_layers[index]:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.mlp_bias, cfg.hidden_act, dtype, policy)
        else:
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
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, policy) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, policy)
        self.lm_head = make_linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, policy=policy)
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
        if self._fused_decode_applies(hidden, meta, kv_caches):
            return self._fused_decode(hidden, positions, kv_caches, meta)
        rope = self.rotary.batch(positions, hidden.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv, meta)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- the fused CPU decode path ----
    def _fused_decode_applies(self, hidden: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]) -> bool:
        """Decode-only batches on CPU with Anna's kernels run all layers in one C call."""
        policy = self.layers[0].self_attn.policy
        if (policy.cpu is None or not policy.fused_decode or policy.profiler is not None or hidden.device.type != "cpu" or hidden.dtype != torch.float32 or meta.prefills
                or meta.num_decode_tokens != hidden.shape[0] or hidden.shape[0] > policy.cpu_gemv_max_rows
                or kv_caches[0][0].dtype != torch.float32):
            return False
        if getattr(self, "_fusable", None) is None:
            self._fusable = self.config.moe is None and all(lin.interleaved for layer in self.layers
                                for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj))
        if not self._fusable:
            return False
        return not (isinstance(self.layers[0].mlp.gate_up_proj, QuantLinear)
                    and not self.layers[0].mlp.gate_up_proj.uses_packed_kernel(hidden.shape[0]))

    def _fused_decode(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.config
        layers = self._layer_descriptors(kv_caches)
        return self.layers[0].self_attn.policy.cpu.decode_layers(
            layers, hidden.contiguous(), heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps,
            positions=positions.contiguous(), slots=meta.slot_mapping.contiguous(),
            tables=meta.decode_block_tables.contiguous(), context_lens=meta.decode_context_lens.contiguous(),
            block_size=meta.block_size, window=cfg.sliding_window, scale=cfg.head_dim ** -0.5,
            cos_table=self.rotary.cos, sin_table=self.rotary.sin, final_norm=self.norm.weight)

    def _layer_descriptors(self, kv_caches: list[KVCache]):
        """ctypes descriptors of every layer's weights and caches, built once (they never move)."""
        key = tuple(k.data_ptr() for k, _ in kv_caches)
        cached = getattr(self, "_descriptors", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        keep: list[torch.Tensor] = []  # fp32 copies of biases, kept alive with the descriptors
        array = (AnnaLayer * len(self.layers))()
        for desc, layer, (k_cache, v_cache) in zip(array, self.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            desc.input_norm = layer.input_layernorm.weight.data_ptr()
            desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            desc.q_norm = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None
            desc.k_norm = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None
            desc.norm_wtype = WEIGHT_TYPES[layer.input_layernorm.weight.dtype]
            for field, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                               ("down", mlp.down_proj)):
                _describe_linear(getattr(desc, field), lin, keep)
            desc.k_cache, desc.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self._descriptors = (key, array, keep)
        return array

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
        for ours, theirs in ARCHITECTURES[self.config.architecture].checkpoint_names:
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


def _describe_linear(desc: AnnaLinear, lin: Linear | QuantLinear, keep: list[torch.Tensor]) -> None:
    bias = None if lin.bias is None else lin.bias.detach().float().contiguous()
    if bias is not None:
        keep.append(bias)
    desc.bias = None if bias is None else bias.data_ptr()
    desc.n, desc.k = lin.out_features, lin.in_features
    if isinstance(lin, QuantLinear):
        desc.weight, desc.scales = lin.qweight.data_ptr(), lin.scales.data_ptr()
        desc.wtype, desc.qkind, desc.group = -1, lin.kind, lin.group
    else:
        desc.weight, desc.scales = lin.weight.data_ptr(), None
        desc.wtype, desc.qkind, desc.group = WEIGHT_TYPES[lin.weight.dtype], 0, 0


def _load_linear(module: Linear | QuantLinear, kind: str, shard: int, tensor: torch.Tensor, name: str,
                 where: str) -> None:
    module.load(kind, shard, tensor, name, where)


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str, where: str) -> None:
    check_shape(name, where, tuple(param.shape), tuple(tensor.shape))
    param.data.copy_(tensor)
