"""The CPU's decode executor: a decode-only step runs the whole decoder stack in one C call
(csrc/decode_layers.c for the Llama family, csrc/decode_hybrid.c for the dense Qwen3.5 models),
since per-op Python dispatch costs as much as the weight reads at this size. Prefill and mixed
steps run the model op by op; so do steps this stack cannot serve (more rows than the
weight-streaming kernel takes, int4 routed to dequant).
"""

from __future__ import annotations

import ctypes

import torch

from anna.model.attention import AttentionMetadata, PagedKV
from anna.model.linear import Linear, QuantLinear
from anna.model.ops import ModelOps
from anna.platforms.cpu.kernels import (WEIGHT_TYPES, AnnaHybridLayer, AnnaLayer, AnnaLinear, kernels_read,
                                        kv_format_descriptor)


class FusedDecodeExecutor:
    spare_blocks = 0  # it writes only the slots of the requests it runs

    def __init__(self, model: torch.nn.Module, ops: ModelOps) -> None:
        self.model = model
        self.ops = ops
        self._fusable: bool | None = None
        self._descriptors: tuple | None = None

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """The stack is the Llama family's dense decoder (no experts)."""
        from anna.model.llama import LlamaForCausalLM

        return isinstance(model, LlamaForCausalLM) and model.config.moe is None

    def attach(self, kv_caches: list[PagedKV], pad_block: int) -> None:
        pass  # descriptors are built on first use, from the caches each step hands in

    def _linears(self, layer: torch.nn.Module) -> tuple:
        return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj

    def applies(self, meta: AttentionMetadata, num_tokens: int, kv_caches: list) -> bool:
        if meta.prefills or meta.num_decode_tokens != num_tokens or num_tokens > self.ops.routing.gemv_max_rows:
            return False
        layers = self.model.layers
        if self._fusable is None:  # (weights and caches keep their layout and dtype: checked once)
            self._fusable = all(lin.interleaved for layer in layers for lin in self._linears(layer)) and all(
                t.dtype == torch.float32 for cache in kv_caches if isinstance(cache, dict) for t in cache.values()
            ) and all(kernels_read(cache.format) for cache in kv_caches if isinstance(cache, PagedKV))
        if not self._fusable:
            return False
        gate_up = layers[0].mlp.gate_up_proj
        return not (isinstance(gate_up, QuantLinear) and not gate_up.uses_packed_kernel(num_tokens))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[PagedKV],
            meta: AttentionMetadata) -> torch.Tensor:
        model = self.model
        cfg = model.config
        hidden = model.embed(input_ids)
        return self.ops.kernels.decode_layers(
            self._layer_descriptors(kv_caches), hidden.contiguous(), heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps, positions=positions.contiguous(), slots=meta.slot_mapping.contiguous(),
            tables=meta.decode_block_tables.contiguous(), context_lens=meta.decode_context_lens.contiguous(),
            block_size=meta.block_size, window=cfg.sliding_window, scale=cfg.head_dim ** -0.5,
            cos_table=model.rotary.cos, sin_table=model.rotary.sin, final_norm=model.norm.weight)

    def warm_up(self, batch_sizes: list[int]) -> int:
        return 0  # nothing to capture: the warmup table's decode steps run it

    def _layer_descriptors(self, kv_caches: list[PagedKV]):
        """ctypes descriptors of every layer's weights and caches, built once (they never move; the
        routing's bf16 bounds, which calibration may set, are part of the key)."""
        key = (tuple(k.data_ptr() for k, _ in kv_caches), _bf16_bounds(self.ops))
        if self._descriptors is not None and self._descriptors[0] == key:
            return self._descriptors[1]
        keep: list[torch.Tensor] = []  # fp32 copies of biases, kept alive with the descriptors
        layers = self.model.layers
        array = (AnnaLayer * len(layers))()
        for desc, layer, kv_cache in zip(array, layers, kv_caches):
            k_cache, v_cache = kv_cache
            attn, mlp = layer.self_attn, layer.mlp
            desc.input_norm = layer.input_layernorm.weight.data_ptr()
            desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            desc.q_norm = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None
            desc.k_norm = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None
            desc.norm_wtype = WEIGHT_TYPES[layer.input_layernorm.weight.dtype]
            for field, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                               ("down", mlp.down_proj)):
                _describe_linear(getattr(desc, field), lin, keep, self.ops)
            desc.k_cache, desc.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            desc.kv_format = ctypes.addressof(kv_format_descriptor(kv_cache.format))
        self._descriptors = (key, array, keep)
        return array


def _describe_linear(desc: AnnaLinear, lin: Linear | QuantLinear, keep: list[torch.Tensor], ops: ModelOps) -> None:
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
        desc.bf16_dot_rows, desc.bf16_pair_max_rows = _bf16_bounds(ops)


def _bf16_bounds(ops: ModelOps) -> tuple[int, int]:
    """The routing's bounds of the kernel's bf16 paths without a conversion pass (LinearRouting)."""
    return ops.routing.bf16_dot_rows, ops.routing.bf16_pair_max_rows


class HybridFusedDecodeExecutor(FusedDecodeExecutor):
    """The stack of a dense Qwen3.5 model: Gated DeltaNet and gated attention layers."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        from anna.model.qwen3_5 import Qwen3_5ForCausalLM

        return isinstance(model, Qwen3_5ForCausalLM) and model.config.moe is None

    def _linears(self, layer: torch.nn.Module) -> tuple:
        if layer.is_linear:
            mixer = layer.linear_attn
            return mixer.in_proj, mixer.in_proj_ba, mixer.out_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
        return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layer_caches: list,
            meta: AttentionMetadata) -> torch.Tensor:
        model = self.model
        cfg, lin = model.config, model.config.linear_attention
        hidden = model.embed(input_ids)
        return self.ops.kernels.decode_hybrid_layers(
            self._layer_descriptors(layer_caches), hidden.contiguous(), heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rope_dim=cfg.rope_dim,
            intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps, positions=positions.contiguous(),
            slots=meta.slot_mapping.contiguous(), tables=meta.decode_block_tables.contiguous(),
            context_lens=meta.decode_context_lens.contiguous(), block_size=meta.block_size,
            scale=cfg.head_dim ** -0.5, cos_table=model.rotary.cos, sin_table=model.rotary.sin,
            state_slots=meta.state_slots.contiguous(), state_src_slots=meta.state_src_slots, key_heads=lin.num_key_heads, value_heads=lin.num_value_heads,
            key_dim=lin.key_head_dim, value_dim=lin.value_head_dim, conv_kernel=lin.conv_kernel,
            final_norm=model.norm.weight)

    def _layer_descriptors(self, layer_caches: list):
        key = (tuple(next(iter(c.values())).data_ptr() if isinstance(c, dict) else c[0].data_ptr()
                     for c in layer_caches), _bf16_bounds(self.ops))
        if self._descriptors is not None and self._descriptors[0] == key:
            return self._descriptors[1]
        keep: list[torch.Tensor] = []
        layers = self.model.layers
        array = (AnnaHybridLayer * len(layers))()
        for desc, layer, cache in zip(array, layers, layer_caches):
            desc.linear = int(layer.is_linear)
            desc.input_norm = layer.input_layernorm.weight.data_ptr()
            desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            _describe_linear(desc.gate_up, layer.mlp.gate_up_proj, keep, self.ops)
            _describe_linear(desc.down, layer.mlp.down_proj, keep, self.ops)
            if layer.is_linear:
                mixer = layer.linear_attn
                for field, lin in (("in_proj", mixer.in_proj), ("ba", mixer.in_proj_ba), ("out_proj", mixer.out_proj)):
                    _describe_linear(getattr(desc, field), lin, keep, self.ops)
                desc.conv_weight, desc.a_log = mixer.conv_weight.data_ptr(), mixer.A_log.data_ptr()
                desc.dt_bias, desc.gated_norm = mixer.dt_bias.data_ptr(), mixer.norm.weight.data_ptr()
                desc.gated_norm_wtype = WEIGHT_TYPES[mixer.norm.weight.dtype]
                desc.conv_state, desc.recurrent_state = cache["conv"].data_ptr(), cache["recurrent"].data_ptr()
            else:
                attn = layer.self_attn
                _describe_linear(desc.qkv, attn.qkv_proj, keep, self.ops)
                _describe_linear(desc.o, attn.o_proj, keep, self.ops)
                desc.q_norm, desc.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
                desc.k_cache, desc.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
                desc.kv_format = ctypes.addressof(kv_format_descriptor(cache.format))
        self._descriptors = (key, array, keep)
        return array


def fused_decode_executor(model: torch.nn.Module, ops: ModelOps) -> FusedDecodeExecutor | None:
    """The fused stack that serves this model, or None."""
    for executor in (FusedDecodeExecutor, HybridFusedDecodeExecutor):
        if executor.supports(model):
            return executor(model, ops)
    return None
