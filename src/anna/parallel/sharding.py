"""Tensor parallelism as a transform of the plain model (as gpt-fast does it): the model is built
with one rank's share of the heads, MLP columns and vocabulary (``local_config``), each linear
layer learns which rows or columns of its checkpoint tensors it keeps (``LinearShard``), and the
outputs of the attention and MLP blocks are summed across ranks by forward hooks. Nothing inside
a layer's ``forward`` knows about ranks.

The split, for ``size`` ranks and rank ``r``:
- attention: query heads split evenly; KV heads split evenly, or, where there are fewer KV heads
  than ranks, each rank keeps the one KV head its query heads read (replicated size / kv times);
  ``o_proj`` keeps the matching input columns (row-parallel), its bias on rank 0 only.
- MLP, routed experts and the shared expert: gate/up rows and down columns split evenly (each
  expert keeps all its rows of tokens, so routing stays as it is; the router is replicated).
- embedding and lm_head: the vocabulary in equal slices (the last padded with zero rows); a
  lookup outside the slice gives zeros and the ranks' rows are summed, the logits are gathered.
The attention block's and the MLP block's outputs are all-reduced (one sum each per layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from anna.model.config import ModelConfig
from anna.model.quantization import PackedWeight, dense, quantize_int8
from anna.parallel.collectives import Collectives


Ranges = tuple[tuple[int, int], ...]  # (first row, rows) runs of a tensor, taken in order


@dataclass(frozen=True)
class LinearShard:
    """Which part of each checkpoint tensor of one linear layer a rank keeps: ``rows`` per fused
    part (q/k/v, gate/up) as runs of (first row, rows), rows past the tensor's end are zeros (a
    padded vocabulary); or ``cols`` (first input column, columns) for a row-parallel layer, whose
    bias only ``keeps_bias`` ranks add (the ranks' outputs are summed)."""

    rows: tuple[Ranges, ...] | None = None
    cols: tuple[int, int] | None = None
    keeps_bias: bool = True

    def take(self, kind: str, part: int, tensor: torch.Tensor | PackedWeight,
             row_scales: bool = False) -> torch.Tensor | PackedWeight:
        """``row_scales``: the layer stores int8 with one scale per row, which must be the whole
        row's: a row-parallel share is quantized whole, then its columns taken."""
        if self.cols is not None:
            if kind == "bias":
                return tensor if self.keeps_bias else torch.zeros_like(tensor)
            if row_scales and not isinstance(tensor, PackedWeight):
                values, scales = quantize_int8(tensor)
                start, length = self.cols
                return PackedWeight("int8", values[:, start:start + length], scales, 0)
            return narrow_cols(tensor, *self.cols)
        if self.rows is not None:
            return take_rows(tensor, self.rows[part])
        return tensor


def take_rows(tensor: torch.Tensor | PackedWeight, ranges: Ranges) -> torch.Tensor | PackedWeight:
    """The rows of these runs, one after another (Gated DeltaNet's q, k and v heads of a rank)."""
    if len(ranges) == 1:
        return narrow_rows(tensor, *ranges[0])
    index = torch.cat([torch.arange(start, start + length) for start, length in ranges])
    return tensor.rows(index) if isinstance(tensor, PackedWeight) else tensor[index]


def narrow_rows(tensor: torch.Tensor | PackedWeight, start: int, length: int) -> torch.Tensor | PackedWeight:
    """Rows [start, start + length) of a checkpoint tensor; rows past its end are zeros."""
    have = max(0, min(length, tensor.shape[0] - start))
    if have == length:
        return tensor.rows(slice(start, start + length)) if isinstance(tensor, PackedWeight) \
            else tensor[start:start + length]
    values = dense(tensor)
    out = values.new_zeros((length, *values.shape[1:]))
    out[:have] = values[start:start + have]
    return out


def narrow_cols(tensor: torch.Tensor | PackedWeight, start: int, length: int) -> torch.Tensor | PackedWeight:
    """Input columns [start, start + length) of a weight; a packed weight stays packed where the
    columns fall on whole groups of its scales."""
    if not isinstance(tensor, PackedWeight):
        return tensor[:, start:start + length]
    if start % tensor.group or length % tensor.group:
        return dense(tensor)[:, start:start + length]
    per_byte = 2 if tensor.method == "int4" else 1
    return PackedWeight(tensor.method, tensor.values[:, start // per_byte:(start + length) // per_byte],
                        tensor.scales[:, start // tensor.group:(start + length) // tensor.group], tensor.group)


@dataclass
class VocabShard:
    """This rank's slice of the vocabulary: token ids [start, start + size), of ``vocab`` in all."""

    start: int
    size: int
    vocab: int
    comm: Collectives

    def take_rows(self, tensor: torch.Tensor | PackedWeight) -> torch.Tensor | PackedWeight:
        return narrow_rows(tensor, self.start, self.size)

    def embed(self, lookup: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows from the rank that holds each id, summed over ranks."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.size)
        rows = lookup(local.masked_fill(outside, 0))
        return self.comm.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(logits)[..., :self.vocab]


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank ``rank`` of ``size``: what it keeps of a model."""

    rank: int
    size: int

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a model that cannot be split this way, naming the setting."""
        def refuse(why: str) -> None:
            raise ValueError(f"tensor_parallel_size: {self.size} ranks cannot split {cfg.architecture}: {why}")

        lin = cfg.linear_attention
        if lin is not None and lin.num_key_heads % self.size:
            refuse(f"{lin.num_key_heads} Gated DeltaNet key heads do not divide evenly")
        if cfg.load_mtp:
            refuse("a multi-token-prediction head is not split across ranks yet")
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if heads % self.size:
            refuse(f"{heads} attention heads do not divide evenly")
        if kv % self.size and self.size % kv:
            refuse(f"{kv} KV heads neither divide evenly nor divide the ranks (each rank would need a share of "
                   f"several KV heads)")
        sizes = {"intermediate_size": cfg.intermediate_size}
        if cfg.moe is not None:
            sizes["moe_intermediate_size"] = cfg.moe.intermediate_size
            sizes["shared_expert_intermediate_size"] = cfg.moe.shared_expert_intermediate_size
        for name, value in sizes.items():
            if value % self.size:
                refuse(f"{name} {value} does not divide evenly")

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's share, which the model class builds as it would a whole model."""
        self.check(cfg)
        moe = cfg.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size,
                                      shared_expert_intermediate_size=moe.shared_expert_intermediate_size // self.size)
        lin = cfg.linear_attention
        if lin is not None:  # value heads follow their key heads
            lin = dataclasses.replace(lin, num_key_heads=lin.num_key_heads // self.size,
                                      num_value_heads=lin.num_value_heads // self.size)
        return dataclasses.replace(
            cfg, num_attention_heads=cfg.num_attention_heads // self.size,
            num_key_value_heads=max(1, cfg.num_key_value_heads // self.size),
            intermediate_size=cfg.intermediate_size // self.size, moe=moe, linear_attention=lin,
            vocab_size=-(-cfg.vocab_size // self.size))

    def apply(self, model: nn.Module, cfg: ModelConfig, comm: Collectives) -> None:
        """Mark what each layer keeps of the checkpoint (``cfg``: the whole model's config) and sum
        the blocks' outputs across ranks. Call on the freshly built model, before loading."""
        r = self.rank
        for layer in model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                self._shard_attention(attn, cfg, model.config)
            else:
                self._shard_gated_delta(layer.linear_attn, cfg.linear_attention)
            for mlp in _gated_mlps(layer.mlp):
                width = mlp.down_proj.in_features
                mlp.gate_up_proj.tensor_parallel = LinearShard(rows=(((r * width, width),), ((r * width, width),)))
                mlp.down_proj.tensor_parallel = LinearShard(cols=(r * width, width), keeps_bias=r == 0)
            for block in (attn if attn is not None else layer.linear_attn, layer.mlp):
                block.register_forward_hook(lambda module, args, out: comm.all_reduce(out))
        vocab = model.config.vocab_size
        model.lm_head.tensor_parallel = LinearShard(rows=(((r * vocab, vocab),),))
        model.vocab_shard = VocabShard(r * vocab, vocab, cfg.vocab_size, comm)

    def _shard_attention(self, attn: nn.Module, cfg: ModelConfig, local: ModelConfig) -> None:
        """This rank's query heads (with their output gates where the projection carries them:
        Qwen3.5's [query | gate] per head) and the KV heads they read; o_proj's matching columns."""
        r, hd = self.rank, cfg.head_dim
        q, kv = local.num_attention_heads, local.num_key_value_heads
        first_kv = (r * q) // (cfg.num_attention_heads // cfg.num_key_value_heads)
        per_head = attn.split[0] // (q * hd)  # 1, or 2 with a gate
        attn.qkv_proj.tensor_parallel = LinearShard(rows=(((r * q * hd * per_head, q * hd * per_head),),
                                                          ((first_kv * hd, kv * hd),), ((first_kv * hd, kv * hd),)))
        attn.o_proj.tensor_parallel = LinearShard(cols=(r * q * hd, q * hd), keeps_bias=r == 0)

    def _shard_gated_delta(self, layer: nn.Module, lin: Any) -> None:
        """Gated DeltaNet: this rank's key heads and the value heads they serve, in q, k, v (and the
        conv's channels over them), z, b, a, A_log and dt_bias; out_proj's matching columns."""
        r, size = self.rank, self.size
        kh, vh = lin.num_key_heads // size, lin.num_value_heads // size
        q = (r * kh * lin.key_head_dim, kh * lin.key_head_dim)
        k = (lin.key_dim + q[0], q[1])
        v_rows = (r * vh * lin.value_head_dim, vh * lin.value_head_dim)
        v = (2 * lin.key_dim + v_rows[0], v_rows[1])
        heads = ((r * vh, vh),)
        channels = (q, k, v)
        layer.in_proj.tensor_parallel = LinearShard(rows=(channels, (v_rows,)))
        layer.in_proj_ba.tensor_parallel = LinearShard(rows=(heads, heads))
        layer.out_proj.tensor_parallel = LinearShard(cols=v_rows)
        layer.tensor_parallel = GatedDeltaShard(channels, heads, (r * kh, kh))


@dataclass(frozen=True)
class GatedDeltaShard:
    """What a rank keeps of a Gated DeltaNet layer's own tensors: the conv's channels (q, k, v)
    and the per-value-head vectors as row runs, and its key heads (first, count), by which
    Qwen3-Next's fused projections are grouped."""

    channels: Ranges
    heads: Ranges
    key_heads: tuple[int, int]

    def key_head_rows(self, tensor: torch.Tensor, rows_per_key_head: int) -> torch.Tensor:
        """A projection grouped per key head: the rows of this rank's key heads."""
        first, count = self.key_heads
        return narrow_rows(tensor, first * rows_per_key_head, count * rows_per_key_head)


def _gated_mlps(mlp: nn.Module) -> list[nn.Module]:
    """The gated MLPs in a layer's MLP block: itself, or a mixture's experts and shared expert."""
    experts = getattr(mlp, "experts", None)
    if experts is None:
        return [mlp]
    return [*experts, *([mlp.shared_expert] if mlp.shared_expert is not None else [])]
