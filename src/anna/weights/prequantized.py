"""Checkpoints that are already quantized (config.json's ``quantization_config``): GPTQ, AWQ,
FP8 (fine-grained block scales or per tensor / channel) and compressed-tensors.

``checkpoint_quantization`` reads the config and refuses, naming the method and what is
supported, whatever Anna cannot run, before any tensor is read. ``CheckpointConverter`` then
sits between the shards and the model: it collects the parts a quantized layer is stored as
(GPTQ's qweight, qzeros, scales and g_idx; FP8's weight and its scale) and hands the model one
``.weight`` per layer: a ``PackedWeight`` where the checkpoint's int4 or int8 is Anna's exactly
(symmetric groups of 32, 64 or 128 in input order: stored value = value + 2^(bits-1)), else the dequantized
weight, which the layer quantizes again into the format served (``quantization``) or keeps in
floats. Asymmetric groups (AWQ, GPTQ sym=false) and GPTQ's act-order (groups that are not runs
of input columns) have no exact form in Anna's int4, whose kernels know no zero point: they take
the second rounding (tests/test_prequantized.py measures its error).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from anna.model.config import ModelLoadError
from anna.model.quantization import INT4_GROUP_SIZES, PackedWeight, pack_int4

log = logging.getLogger(__name__)

SUPPORTED = ("gptq (4/8-bit)", "awq (4-bit, gemm)", "fp8 (e4m3, block or per-tensor scales)",
             "compressed-tensors (fp8 float-quantized; 4/8-bit symmetric pack-quantized)")
KV_SCALES = ("k_scale", "v_scale")  # FP8 KV scales: Anna's fp8/int8 KV keeps a scale per row instead
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ's gemm packing puts column order[i] in nibble i


@dataclass(frozen=True)
class CheckpointQuantization:
    """What ``quantization_config`` says, reduced to what the converter needs."""

    method: str  # gptq | awq | fp8
    bits: int = 4
    group: int = 0  # input columns per scale; 0: one scale for the whole row
    symmetric: bool = True
    act_order: bool = False
    zeros_offset: int = 0  # GPTQ v1 stores zero - 1
    layout: str = ""  # gptq | awq | packed (compressed-tensors) | fp8
    label: str = ""  # as the log names it
    quantizes_lm_head: bool = False  # GPTQ's lm_head=true; otherwise the checkpoint keeps it in floats

    def auto_format(self) -> tuple[str, int, str]:
        """(quantization, group size, why) for quantization=auto: int4 (int8 for 8-bit weights) at
        the checkpoint's group where that is exact, else in groups of 32; floats for FP8."""
        if self.method == "fp8":
            return "none", 32, f"{self.label}: FP8 weights dequantized to the serving dtype (--quantization int8 " \
                               "stores them in int8: half the bytes, a second rounding)"
        method = "int8" if self.bits == 8 else "int4"
        exact = self.symmetric and not self.act_order and self.group in INT4_GROUP_SIZES
        group = self.group if exact else 32  # a second rounding: in the finest groups
        how = "repacked as they are" if exact else "dequantized and quantized again (" + (
            "zero points" if not self.symmetric else "act-order" if self.act_order else f"group {self.group}") + \
            f" have no exact form in Anna's {method})"
        return method, group, f"{self.label}: {method} group {group}, {how}"


def checkpoint_quantization(raw: dict[str, Any], where: str) -> CheckpointQuantization | None:
    """The checkpoint's quantization, or None for a float checkpoint. Raises ModelLoadError,
    naming the method, for any Anna cannot run."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{where}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: quantization_config: {what} is not supported; Anna loads "
                              f"{'; '.join(SUPPORTED)} checkpoints, GGUF files, and float checkpoints")

    if method == "gptq":
        bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", -1))
        if bits not in (4, 8):
            raise refuse(f"GPTQ with {bits}-bit weights")
        v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        return CheckpointQuantization("gptq", bits, max(group, 0), bool(qc.get("sym", True)),
                                      bool(qc.get("desc_act", False)), 0 if v2 else 1, "gptq",
                                      f"GPTQ {bits}-bit group {group}", bool(qc.get("lm_head", False)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or int(qc.get("bits", qc.get("w_bit", 4))) != 4:
            raise refuse(f"AWQ version {version!r} with {qc.get('bits', qc.get('w_bit', 4))}-bit weights")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        return CheckpointQuantization("awq", 4, max(group, 0), not qc.get("zero_point", True), False, 0, "awq",
                                      f"AWQ group {group}")
    if method == "fp8":
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise refuse(f"FP8 format {qc.get('fmt')!r}")
        block = qc.get("weight_block_size")
        return CheckpointQuantization("fp8", 8, 0, True, False, 0, "fp8",
                                      f"FP8 e4m3 {'block ' + 'x'.join(map(str, block)) if block else 'per tensor'}")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, refuse)
    raise refuse(f"method {method or '(none given)'!r}")


def _compressed_tensors(qc: dict[str, Any], refuse) -> CheckpointQuantization:
    fmt = str(qc.get("format", "")).lower()
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [g.get("weights") or {} for g in groups]
    if len(weights) != 1:
        raise refuse(f"compressed-tensors with {len(weights)} config groups")
    w = weights[0]
    bits, kind, strategy = int(w.get("num_bits", 0)), str(w.get("type", "")), str(w.get("strategy", ""))
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        return CheckpointQuantization("fp8", 8, 0, True, False, 0, "fp8", f"compressed-tensors FP8 ({strategy})")
    if fmt == "pack-quantized" and kind == "int" and bits in (4, 8) and w.get("symmetric", True) \
            and strategy in ("group", "channel"):
        group = int(w.get("group_size") or 0) if strategy == "group" else 0
        return CheckpointQuantization("packed", bits, group, True, bool(w.get("actorder")), 0, "packed",
                                      f"compressed-tensors int{bits} {strategy} {group or ''}".strip())
    raise refuse(f"compressed-tensors format {fmt!r} with {kind}{bits} weights ({strategy}, "
                 f"symmetric={w.get('symmetric', True)})")


# the tensor names each layout stores a quantized layer as (beside an optional bias)
PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
         "packed": ("weight_packed", "weight_scale", "weight_shape", "weight_g_idx"),
         "fp8": ("weight", "weight_scale", "weight_scale_inv")}
REQUIRED = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
            "packed": ("weight_packed", "weight_scale")}
DROPPED = ("input_scale", *KV_SCALES)  # static activation scales: Anna quantizes activations per block itself


@dataclass
class CheckpointConverter:
    """Turns a shard's quantized layers into one ``.weight`` each (see the module's docstring)."""

    quant: CheckpointQuantization
    pending: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    exact: int = 0
    dequantized: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def convert(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        layout = self.quant.layout
        for name, tensor in tensors:
            prefix, _, part = name.rpartition(".")
            if part in DROPPED:
                self.dropped[part] = self.dropped.get(part, 0) + 1
                continue
            if part not in PARTS[layout] or (layout == "fp8" and part == "weight" and tensor.element_size() != 1):
                yield name, tensor  # a layer left in floats (lm_head, routers, norms), biases
                continue
            parts = self.pending.setdefault(prefix, {})
            parts[part] = tensor
            if self._complete(parts):
                yield f"{prefix}.weight", self._weight(prefix, self.pending.pop(prefix))

    def finish(self, where: str) -> list[str]:
        """After the last shard: lines for the log; an error for a layer whose parts did not all come."""
        if self.pending:
            prefix, parts = next(iter(self.pending.items()))
            raise ModelLoadError(f"{where}: quantized layer {prefix} has {', '.join(sorted(parts))} but not all the "
                                 f"parts {self.quant.label} stores a layer as")
        if any(k in self.dropped for k in KV_SCALES):
            log.warning("%s: the checkpoint's FP8 KV scales (k_scale, v_scale) are ignored: Anna's fp8/int8 KV "
                        "cache (--kv-cache-dtype) keeps a scale per row", where)
        return [f"{self.quant.label}: {self.exact} layer(s) repacked into Anna's int{self.quant.bits} as they are, "
                f"{self.dequantized} dequantized at load"]

    def _complete(self, parts: dict[str, torch.Tensor]) -> bool:
        if self.quant.layout == "fp8":
            return "weight" in parts and ("weight_scale" in parts or "weight_scale_inv" in parts)
        return all(p in parts for p in REQUIRED[self.quant.layout])

    def _weight(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor | PackedWeight:
        layout = self.quant.layout
        try:
            if layout == "fp8":
                return self._counted(fp8_weight(parts["weight"], parts.get("weight_scale_inv",
                                                                             parts.get("weight_scale"))))
            if layout == "gptq":
                q, zeros, scales, g_idx = gptq_parts(parts, self.quant.bits, self.quant.zeros_offset)
            elif layout == "awq":
                q, zeros, scales, g_idx = awq_parts(parts)
            else:
                q, zeros, scales, g_idx = packed_parts(parts, self.quant.bits)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise ModelLoadError(f"quantized layer {prefix}: its tensors do not fit the {self.quant.label} layout "
                                 f"({exc})") from None
        return self._counted(int_weight(q, zeros, scales, g_idx, self.quant.bits))

    def _counted(self, weight: torch.Tensor | PackedWeight) -> torch.Tensor | PackedWeight:
        if isinstance(weight, PackedWeight):
            self.exact += 1
        else:
            self.dequantized += 1
        return weight


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32/bits values (value i at bits i*bits), along ``dim`` (0: rows, 1: columns)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    words = packed.to(torch.int32)
    if dim == 0:
        values = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return values.reshape(-1, words.shape[1])
    values = (words[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], -1)


def gptq_parts(parts: dict[str, torch.Tensor], bits: int, zeros_offset: int):
    """GPTQ: qweight [K*bits/32, N] packed along K, qzeros [G, N*bits/32] along N (v1: zero - 1),
    scales [G, N], g_idx [K] (each input column's group). Returns q [N, K], zeros [N, G],
    scales [N, G], g_idx [K]."""
    q = _unpack(parts["qweight"], bits, 0).T
    zeros = (_unpack(parts["qzeros"], bits, 1) + zeros_offset).T
    scales = parts["scales"].T
    k, groups = q.shape[1], scales.shape[1]
    g_idx = parts.get("g_idx")
    g_idx = torch.arange(k) // (k // groups) if g_idx is None else g_idx.long()
    return q, zeros[: q.shape[0]], scales, g_idx


def awq_parts(parts: dict[str, torch.Tensor]):
    """AWQ (gemm): qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's nibble order,
    scales [G, N]; groups are runs of input columns."""
    def columns(packed: torch.Tensor) -> torch.Tensor:
        values = _unpack(packed, 4, 1)
        return values.view(values.shape[0], -1, 8)[:, :, AWQ_REVERSE_ORDER].reshape(values.shape[0], -1)

    q, zeros, scales = columns(parts["qweight"]).T, columns(parts["qzeros"]).T, parts["scales"].T
    k, groups = q.shape[1], scales.shape[1]
    return q, zeros, scales, torch.arange(k) // (k // groups)


def packed_parts(parts: dict[str, torch.Tensor], bits: int):
    """compressed-tensors pack-quantized (symmetric): weight_packed [N, K*bits/32] packed along K,
    stored as value + 2^(bits-1); weight_scale [N, G] (channel: [N, 1])."""
    q = _unpack(parts["weight_packed"], bits, 1)
    shape = parts.get("weight_shape")
    if shape is not None:
        q = q[: int(shape[0]), : int(shape[1])]
    scales = parts["weight_scale"]
    k, groups = q.shape[1], scales.shape[1]
    zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    g_idx = parts.get("weight_g_idx")
    return q, zeros, scales, (torch.arange(k) // (k // groups) if g_idx is None else g_idx.long())


def int_weight(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               bits: int) -> torch.Tensor | PackedWeight:
    """w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g] with g = g_idx[k]: Anna's int4 as it is
    when that is exactly its format, else the fp32 weight."""
    n, k = q.shape
    groups = scales.shape[1]
    group = k // groups if k % groups == 0 else 0
    in_order = group > 0 and torch.equal(g_idx, torch.arange(k) // group)
    if in_order and group in INT4_GROUP_SIZES and bool((zeros == 1 << (bits - 1)).all()):
        scales = scales.to(torch.float16).contiguous()
        if bits == 4:
            return PackedWeight("int4", pack_int4(q.to(torch.uint8).contiguous()), scales, group)
        return PackedWeight("int8", (q - 128).to(torch.int8).contiguous(), scales, group)
    return (q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight (float8 e4m3) [N, K] times its scale: one value (per tensor), [N] or [N, 1] (per
    row), or [ceil(N/bn), ceil(K/bk)] (blocks, as Qwen's and DeepSeek's FP8 checkpoints store it)."""
    w = weight.float()
    scale = scale.float()
    if scale.numel() == 1:
        return w * scale.reshape(())
    if scale.dim() == 1 or scale.shape[1] == 1:
        return w * scale.reshape(-1, 1)
    n, k = w.shape
    bn, bk = -(-n // scale.shape[0]), -(-k // scale.shape[1])
    return w * scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
