"""The CPU's ops: torch's with fp32 arithmetic where half precision is slow on a CPU, and, where
Anna's kernels could be built, those kernels (platforms/cpu/kernels.py).

Activations and the KV cache are fp32 on CPU (platforms/cpu/__init__.py), so these ops receive
fp32 activations; weights stay in their own dtype (bf16/fp16, or int8/int4) and the kernels
read them as they are. Matmuls are routed by M (``LinearRouting``): the weight-streaming kernels
for decode-sized M, torch's GEMM above (bf16 for a bf16 model on hardware bf16; at the amx level
Anna's tile kernel, on the weights as stored).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F

from anna.model.attention import AttentionMetadata, PagedKV
from anna.model.layers import RopeBatch
from anna.model.linear import QuantLinear
from anna.model.ops import LinearRouting, ModelOps, QuantFormat
from anna.platforms.cpu.kernels import WEIGHT_TYPES, CpuKernels, kernels_read


class ScratchBuffers:
    """Memory reused from one forward pass to the next for large intermediates that never leave
    the op that makes them (the gated MLP's [gate | up] rows and their product). glibc maps every
    block over 32 MB afresh and unmaps it when freed, so each one costs a page fault and the
    zeroing of every 4 KB page it writes: a 2,048-token prefill's [gate | up] rows (40 MB in bf16)
    made 240,000 faults per prefill, and one 2,048 x 896 x 9,728 bf16 GEMM took 30 ms into fresh
    memory against 18 ms into a buffer written before. Each buffer keeps the largest size asked of
    it (at most max_num_batched_tokens rows)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, width] tensor of ``dtype`` whose contents are undefined, valid until the next
        ``take`` of the same name."""
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < rows * width:
            buf = self._buffers[name] = torch.empty(rows * width, dtype=dtype)
        return buf[:rows * width].view(rows, width)


class CpuTorchOps(ModelOps):
    """torch's kernels on CPU (no C compiler, no AVX2, or --no-cpu-kernels)."""

    attention_dtype = torch.float32  # half-precision batched matmuls are slow without native support

    def __init__(self, quant: QuantFormat = QuantFormat(), routing: LinearRouting = LinearRouting(),
                 profiler: Any = None) -> None:
        super().__init__(quant, routing, profiler)
        self.scratch = ScratchBuffers()

    def runs_bf16(self, layer: Any, rows: int) -> bool:
        """Whether a matmul of ``rows`` rows runs as a bf16 GEMM (a bf16 model on hardware bf16:
        dense bf16 weights as they are, quantized ones dequantized to bf16)."""
        return self.routing.bf16_matmul and (isinstance(layer, QuantLinear) or layer.weight.dtype == torch.bfloat16)

    def serves_stored(self, layer: Any, rows: int) -> bool:
        """Whether Anna's kernels serve a matmul of ``rows`` rows from the weight as stored (no
        copy or conversion of it per call)."""
        return False

    def bf16_weight(self, layer: Any) -> torch.Tensor:
        """The row-major bf16 weight of a layer that ``runs_bf16`` (a copy may be valid only until
        the next call: see CpuKernels._matmul_operand)."""
        if isinstance(layer, QuantLinear):
            with self.region("dequantize"):
                return self.dequantize(layer, dtype=torch.bfloat16)
        return layer.weight

    def linear(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        w = layer.weight
        if w.dtype == x.dtype:
            return super().linear(layer, x)
        rows = x.numel() // x.shape[-1]
        if self.runs_bf16(layer, rows):
            return _with_bias(_bf16_matmul(self, layer, x).to(x.dtype), layer)
        if 0 < self.routing.upcast_min_rows <= rows:
            return _upcast_linear(self, layer, x, w)
        with self.region(layer.profile_name or "matmul:torch_half"):
            return F.linear(x.to(w.dtype), w, layer.bias).to(x.dtype)

    def quant_linear(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """The dequantized GEMM, in bf16 where the routing says so (rounding the dequantized weight
        to bf16 costs well under int4's own error)."""
        if not self.runs_bf16(layer, x.numel() // x.shape[-1]):
            return super().quant_linear(layer, x)
        return _with_bias(_bf16_matmul(self, layer, x).to(x.dtype), layer)

    def gated_mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """In tiles of routing.mlp_tile_rows rows where Anna's kernels serve a tile from the stored
        weights: a 2,048-token prefill's [gate | up] rows are 80 MB in fp32, written to memory and
        read back; a tile's stay in cache, while the layer's weights come from cache too. Otherwise
        the MLP runs whole: on bf16 GEMMs its intermediate is bf16 already, and a path that copies or
        converts the weights for each matmul would do so once per tile."""
        rows, tile = x.numel() // x.shape[-1], self.routing.mlp_tile_rows
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if (not 0 < tile < rows or (self.runs_bf16(gate_up, rows) and self.runs_bf16(down, rows))
                or not (self.serves_stored(gate_up, tile) and self.serves_stored(down, tile))):
            return self._gated_mlp_rows(mlp, x)
        x2 = x.reshape(rows, x.shape[-1])
        out = torch.cat([self._gated_mlp_rows(mlp, x2[i:i + tile]) for i in range(0, rows, tile)])
        return out.view(*x.shape[:-1], out.shape[-1])

    def _gated_mlp_rows(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """Where both matmuls run in bf16, the [gate | up] rows and their product stay in bf16:
        converting those M x 3I values to fp32 and back costs about what the GEMMs do."""
        rows = x.numel() // x.shape[-1]
        if not (self.runs_bf16(mlp.gate_up_proj, rows) and self.runs_bf16(mlp.down_proj, rows)):
            return super().gated_mlp(mlp, x)
        width = mlp.gate_up_proj.out_features
        gate_up = _bf16_matmul(self, mlp.gate_up_proj, x.reshape(rows, x.shape[-1]),
                               out=self.scratch.take("gate_up", rows, width, torch.bfloat16))
        if mlp.gate_up_proj.bias is not None:
            gate_up += mlp.gate_up_proj.bias.to(torch.bfloat16)
        with self.region("silu_mul"):
            act = self.silu_mul(gate_up, out=self.scratch.take("act", rows, width // 2, torch.bfloat16))
        out = _with_bias(_bf16_matmul(self, mlp.down_proj, act).to(x.dtype), mlp.down_proj)
        return out.view(*x.shape[:-1], out.shape[-1])


class CpuKernelOps(CpuTorchOps):
    """Anna's C kernels: weight-streaming and packed quantized matmuls, fused norms, rotary, the
    gated activation, paged decode attention, the Gated DeltaNet decode steps and the greedy argmax."""

    def __init__(self, kernels: CpuKernels, quant: QuantFormat = QuantFormat(),
                 routing: LinearRouting = LinearRouting(), profiler: Any = None) -> None:
        super().__init__(quant, routing, profiler)
        self.kernels = kernels

    def keeps_kernel_layout(self, weight: torch.Tensor) -> bool:
        return self.kernels.supports_weight(weight)

    def streams_weight(self, layer: Any, rows: int) -> bool:
        return layer.interleaved and rows <= self.routing.gemv_max_rows

    def reads_packed(self, layer: Any, rows: int) -> bool:
        if not layer.interleaved:
            return False
        if layer.kind == 0:
            return rows <= self.routing.int8_gemv_m_threshold
        r = self.routing
        return r.int4_matmul == "packed" or (r.int4_matmul == "auto" and rows <= r.int4_gemv_m_threshold)

    def serves_stored(self, layer: Any, rows: int) -> bool:
        return (self.reads_packed if isinstance(layer, QuantLinear) else self.streams_weight)(layer, rows)

    def runs_bf16(self, layer: Any, rows: int) -> bool:
        return not self.serves_stored(layer, rows) and super().runs_bf16(layer, rows)

    def _gated_mlp_rows(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """Where both matmuls run on tiles or panels, the first with the activation in its kernel:
        silu(gate) * up leaves it as the down projection's input (bf16 for the tiles, fp32 for the
        panels), and the gate and up rows stay in cache."""
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        rows = x.numel() // x.shape[-1]
        if self.on_tiles(gate_up, rows) and self.on_tiles(down, rows):
            with self.region(gate_up.profile_name or "matmul:anna_tiles"):
                act = self.kernels.tile_gated_act(x, gate_up.weight, gate_up.bias,
                                                  out=self.scratch.take("act", rows, down.in_features, torch.bfloat16))
            with self.region(down.profile_name or "matmul:anna_tiles"):
                out = self.kernels.tile_matmul(act, down.weight, down.bias, out_dtype=x.dtype)
        elif (self.on_panels(gate_up, rows) and self.on_panels(down, rows)
              and self.kernels.panel_matmul_fits(gate_up.weight, gated=True)):
            with self.region(gate_up.profile_name or "matmul:anna_panels"):
                act = self.kernels.panel_gated_act(x, gate_up.weight, gate_up.bias,
                                                   out=self.scratch.take("act", rows, down.in_features, torch.float32))
            with self.region(down.profile_name or "matmul:anna_panels"):
                out = self.kernels.panel_matmul(act, down.weight, down.bias).to(x.dtype)
        else:
            return super()._gated_mlp_rows(mlp, x)
        return out.view(*x.shape[:-1], down.out_features)

    def bf16_weight(self, layer: Any) -> torch.Tensor:
        if isinstance(layer, QuantLinear) or not layer.interleaved:  # (dequantize: straight to bf16 in C)
            return super().bf16_weight(layer)
        return self._row_major(layer.weight, keep_dtype=True)

    def _row_major(self, weight: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """A row-major copy of a weight kept in the kernels' layout, for one large-M matmul: a pass
        over the whole weight, timed as its own region (at 512 prompt tokens of the 0.5B shape these
        copies were about a seventh of a bf16 prefill on an AMX Xeon, where bf16 weights now go to
        the tile kernel, which reads them as stored: ``on_tiles``)."""
        with self.region("deinterleave"):
            return self.kernels.deinterleave(weight, keep_dtype)

    def on_tiles(self, layer: Any, rows: int) -> bool:
        """Whether a matmul of ``rows`` rows runs on Anna's AMX tile kernel, which reads the weight
        as stored (csrc/tile_matmul.c), where it would otherwise be a bf16 GEMM on a row-major copy."""
        return (not isinstance(layer, QuantLinear) and layer.interleaved and self.runs_bf16(layer, rows)
                and self.kernels.tile_matmul_fits(layer.weight))

    def on_panels(self, layer: Any, rows: int) -> bool:
        """Whether a matmul of ``rows`` rows runs on Anna's register-blocked GEMM for CPUs without
        bf16 arithmetic, which reads the weight as stored (csrc/panel_matmul.c), where it would
        otherwise be torch's fp32 GEMM on an fp32 row-major copy of the weight."""
        return (not self.routing.bf16_matmul and not isinstance(layer, QuantLinear) and layer.interleaved
                and not self.serves_stored(layer, rows) and self.kernels.panel_matmul_fits(layer.weight))

    def linear(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        w = layer.weight
        rows = x.numel() // x.shape[-1]
        if self.streams_weight(layer, rows):
            with self.region(layer.profile_name or "matmul:anna_gemv"):
                return self.kernels.gemv(x, w, layer.bias, self.routing.bf16_dot_rows,
                                         self.routing.bf16_pair_max_rows).to(x.dtype)
        if self.on_tiles(layer, rows):
            with self.region(layer.profile_name or "matmul:anna_tiles"):
                return self.kernels.tile_matmul(x, w, layer.bias, out_dtype=x.dtype)
        if self.on_panels(layer, rows):
            with self.region(layer.profile_name or "matmul:anna_panels"):
                return self.kernels.panel_matmul(x, w, layer.bias).to(x.dtype)
        if self.runs_bf16(layer, rows):
            return _with_bias(_bf16_matmul(self, layer, x).to(x.dtype), layer)
        if layer.interleaved:  # a large M: torch's fp32 GEMM on a row-major copy converted in C
            return _upcast_linear(self, layer, x, self._row_major(w))
        if w.dtype == x.dtype:
            return ModelOps.linear(self, layer, x)
        return _upcast_linear(self, layer, x, w)

    def dequantize(self, layer: Any, rows: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not layer.interleaved:
            return super().dequantize(layer, rows, dtype)
        return self.kernels.dequant(layer.qweight, layer.scales, layer.kind, layer.group, layer.in_features, rows,
                                    dtype)

    def quant_linear(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not self.reads_packed(layer, rows):
            return super().quant_linear(layer, x)
        fmt = "int8" if layer.kind == 0 else "int4"
        with self.region(layer.profile_name or f"matmul:{fmt}_packed"):
            return self.kernels.qgemm(x, layer.qweight, layer.scales, layer.kind, layer.group,
                                      layer.bias).to(x.dtype)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        with self.region("rmsnorm"):
            x = x.contiguous()
            if residual is None:
                return self.kernels.add_rmsnorm(x, None, weight, eps)
            return self.kernels.add_rmsnorm(residual, x, weight, eps), residual

    def rotary(self, q: torch.Tensor, k: torch.Tensor, rope: RopeBatch, heads: int, kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = q.shape[0]
        with self.region("rotary"):
            self.kernels.rotary(q, heads, head_dim, rope.cos_table, rope.sin_table, rope.positions)
            self.kernels.rotary(k, kv_heads, head_dim, rope.cos_table, rope.sin_table, rope.positions)
        return q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up, out)

    def write_kv(self, cache: PagedKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantized and narrower rows are stored by the C kernels (the same bytes the fused decode
        stack writes); fp32 rows are copied by torch."""
        if cache.format.name == "float32" or not kernels_read(cache.format):
            return super().write_kv(cache, k, v, slots)
        self.kernels.kv_write(cache.format, k, cache[0], slots)
        self.kernels.kv_write(cache.format, v, cache[1], slots)

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """Anna's kernel: in bf16 where attention_dtype is bf16, which build_ops sets only on CPUs
        with hardware bf16 (on AMX tiles at the amx level, else on vdpbf16ps), else fp32. On a 2-core
        Zen 4 at 2,048 tokens the vdpbf16ps kernel ran 2.1x the fp32 one and 2.7x torch's SDPA in
        bf16; on a 2-vCPU AMX Xeon the tiles ran 1.4-2x SDPA in bf16 at 64-2,048 tokens, while SDPA
        (oneDNN's tiles) ran 2-3x an earlier vdpbf16ps kernel, of which today's runs 1.3-1.4x on
        Zen 4 (benchmarks/attention_bench.py --prefill). So at the amx level a head size the tiles
        do not take goes to SDPA, and a context of routing.sdpa_min_tokens or more does."""
        bf16, dim, sdpa = self.attention_dtype == torch.bfloat16, q.shape[-1], self.routing.sdpa_min_tokens
        on_sdpa = (dim % 8 or (bf16 and self.kernels.level == "amx" and not self.kernels.tile_attention(dim))
                   or (sdpa and k.shape[0] >= sdpa))
        with self.region("attention:prefill"):
            if on_sdpa:
                return super().causal_attention(q, k, v, scale, mask, window)
            return self.kernels.causal_attention(q, k, v, scale, window, bf16=bf16).to(q.dtype)

    def decode_attention(self, q: torch.Tensor, cache: PagedKV, meta: AttentionMetadata, scale: float,
                         sliding_window: int | None) -> torch.Tensor:
        if not kernels_read(cache.format):
            return super().decode_attention(q, cache, meta, scale, sliding_window)
        return self.kernels.decode_attention(q.contiguous(), cache[0], cache[1], cache.format,
                                             meta.decode_block_tables.contiguous(), meta.decode_context_lens,
                                             sliding_window, scale)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.kernels.argmax(logits)

    def conv_step(self, x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                  src_slots: torch.Tensor | None = None) -> torch.Tensor:
        if conv_state.dtype != torch.float32 or weight.dtype != torch.float32:
            return super().conv_step(x, conv_state, slots, weight, src_slots)
        return self.kernels.conv_step(x, conv_state, slots, weight, src_slots).to(x.dtype)

    def gated_delta_decode(self, layer: Any, conved: torch.Tensor, z: torch.Tensor, ba: torch.Tensor,
                           state: torch.Tensor, slots: torch.Tensor, src_slots: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.gated_delta_decode(conved, z, ba, state, slots, layer.A_log, layer.dt_bias,
                                               layer.norm.weight, layer.norm.eps, layer.lin.num_key_heads,
                                               src_slots).to(conved.dtype)

    def grouped_experts(self, moe: Any, rows: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """Where Anna's kernels would serve every expert's matmuls (the packed quantized kernel, or
        the weight-streaming one), all chosen experts run in one call per projection."""
        gate_up, down = moe.experts[0].gate_up_proj, moe.experts[0].down_proj
        most = max(counts)
        if gate_up.bias is not None:
            return None
        if not (self.serves_stored(gate_up, most) and self.serves_stored(down, most)):
            return None
        active = [e for e, count in enumerate(counts) if count]
        ids = torch.tensor(active, dtype=torch.long)
        starts = torch.tensor([0, *accumulate(counts[e] for e in active)], dtype=torch.long)
        gate_up_tables, down_tables = _pointer_tables(moe)
        with self.region("matmul:experts_grouped"):
            h = self._grouped_matmul(gate_up, gate_up_tables, rows, ids, starts)
            return self._grouped_matmul(down, down_tables, self.kernels.silu_mul(h), ids, starts)

    def _grouped_matmul(self, linear: Any, table: tuple[torch.Tensor, ...], x: torch.Tensor, ids: torch.Tensor,
                        starts: torch.Tensor) -> torch.Tensor:
        """The experts' matmuls of one projection (``linear`` is any expert's: they share shape and format)."""
        if isinstance(linear, QuantLinear):
            return self.kernels.qgemm_experts(x, *table, ids, starts, linear.kind, linear.group, linear.out_features)
        return self.kernels.gemv_experts(x, *table, ids, starts, WEIGHT_TYPES[linear.weight.dtype],
                                         linear.out_features, self.routing.bf16_dot_rows,
                                         self.routing.bf16_pair_max_rows)


def _weight_tensors(linear: Any) -> tuple[torch.Tensor, ...]:
    return (linear.qweight, linear.scales) if isinstance(linear, QuantLinear) else (linear.weight,)


def _pointer_tables(moe: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Every expert's weight data pointers per projection (int64: (weights,) or (qweights, scales)),
    built once and kept on the layer (rebuilt if the weights moved, e.g. onto huge pages)."""
    key = _weight_tensors(moe.experts[0].gate_up_proj)[0].data_ptr()
    if moe.kernel_tables is None or moe.kernel_tables[0] != key:
        def table(name: str) -> tuple[torch.Tensor, ...]:
            per_expert = [_weight_tensors(getattr(expert, name)) for expert in moe.experts]
            return tuple(torch.tensor([tensors[i].data_ptr() for tensors in per_expert], dtype=torch.int64)
                         for i in range(len(per_expert[0])))
        moe.kernel_tables = (key, table("gate_up_proj"), table("down_proj"))
    return moe.kernel_tables[1], moe.kernel_tables[2]


def _bf16_matmul(ops: CpuTorchOps, layer: Any, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T in bf16 (oneDNN's AVX512-BF16 / AMX kernels, several times fp32's rate), without the
    bias; the output in bf16 (into ``out`` [rows, N], where given, for a 2-D x)."""
    w = ops.bf16_weight(layer)
    with ops.region(layer.profile_name or "matmul:torch_bf16"):
        if out is None:
            return F.linear(x.to(torch.bfloat16), w)
        return torch.mm(x.to(torch.bfloat16), w.t(), out=out)


def _with_bias(out: torch.Tensor, layer: Any) -> torch.Tensor:
    return out if layer.bias is None else out.add_(layer.bias.to(out.dtype))


def _upcast_linear(ops: ModelOps, layer: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A matmul of many rows on a half-precision row-major weight where the CPU has no bf16
    arithmetic: in fp32, the weight converted."""
    with ops.region(layer.profile_name or "matmul:torch_fp32_upcast"):
        bias = None if layer.bias is None else layer.bias.float()
        return F.linear(x.float(), w.float(), bias).to(x.dtype)
