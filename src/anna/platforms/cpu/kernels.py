"""Anna's compiled CPU kernels (C), built with the system C compiler on first use, once per kernel
level (LEVEL_CFLAGS: AVX2/FMA/F16C, AVX-512, and AVX-512 with VNNI for the quantized dot products) and
source hash, each source file in its own compiler process, concurrently, then linked. Loaded through
ctypes, which releases the GIL during each call. Where no compiler or no AVX2 is available, Anna runs
torch's kernels instead (one warning)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

from anna.model.kv_format import TURBOQUANT_BITS, KVFormat, rotation, turboquant_levels
from anna.platforms.cpu.isa import CpuIsa, detect_isa

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "csrc"
# decode_attention.c first: it takes most of the build, so it starts before the others
SOURCES = [KERNEL_DIR / name for name in ("decode_attention.c", "cpu_kernels.c", "quant_kernels.c", "decode_layers.c",
                                          "gated_delta.c", "decode_hybrid.c", "kv_cache.c", "prefill_attention.c",
                                          "tile_matmul.c", "panel_matmul.c")]
HEADERS = [KERNEL_DIR / name for name in ("work_split.h", "decode_common.h", "bf16.h", "kv_format.h", "vec_math.h",
                                          "amx_tiles.h", "weight_types.h", "thread_buffer.h")]
CFLAGS = ["-O3", "-fopenmp", "-fPIC"]
# The levels the kernels are built for (isa.py's names), each with the instruction sets it may use;
# a CPU runs the highest one it has (or the one --cpu-isa forces).
# avx512: the weight-streaming kernel in 512-bit vectors (csrc/cpu_kernels.c), with a bf16 dot product
# path (vdpbf16ps, a function target) that the caller runs only on CPUs with AVX512-BF16; avx512_vnni:
# also the quantized dot products on vpdpbusd and int4 tiles of 16 rows (csrc/quant_kernels.c); amx:
# also int4 and int8 matmuls of 16 rows of x or more on AMX int8 tiles, bf16 prompt attention and large-M
# bf16 matmuls on bf16 tiles (csrc/amx_tiles.h, csrc/prefill_attention.c, csrc/tile_matmul.c).
_AVX512 = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
LEVEL_CFLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": _AVX512,
    "avx512_vnni": [*_AVX512, "-mavx512vnni"],
    "amx": [*_AVX512, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
}
# The amx level's code with its tile instructions emulated in C (csrc/amx_tiles.h), on the
# avx512_vnni level's flags: the tests build it to check that code on CPUs without AMX.
AMX_EMULATED_CFLAGS = [*LEVEL_CFLAGS["avx512_vnni"], "-DANNA_AMX_EMULATE"]
WEIGHT_TYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
UNPACK_SCRATCH_BYTES = 128 << 20


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


class AnnaLinear(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("wtype", ctypes.c_int), ("qkind", ctypes.c_int), ("group", ctypes.c_long), ("n", ctypes.c_long),
                ("k", ctypes.c_long), ("bf16_dot_rows", ctypes.c_int), ("bf16_pair_max_rows", ctypes.c_int)]


class AnnaLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("norm_wtype", ctypes.c_int), ("qkv", AnnaLinear), ("o", AnnaLinear),
                ("gate_up", AnnaLinear), ("down", AnnaLinear), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("kv_format", ctypes.c_void_p)]


class AnnaKVFormat(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("dim", ctypes.c_long), ("row_bytes", ctypes.c_long),
                ("rotation", ctypes.c_void_p), ("levels", ctypes.c_void_p), ("bounds", ctypes.c_void_p)]


KV_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2, "fp8_e4m3": 3, "int8": 4, "turboquant4": 5, "turboquant3": 6}


def kv_format_descriptor(fmt: KVFormat) -> AnnaKVFormat:
    """The C description of a KV row format (csrc/kv_format.h), built once per format; it keeps
    TurboQuant's rotation and levels alive."""
    return _kv_descriptor(fmt.name, fmt.head_dim)


@lru_cache(maxsize=None)
def _kv_descriptor(name: str, head_dim: int) -> AnnaKVFormat:
    fmt = KVFormat(name, head_dim)
    desc = AnnaKVFormat(KV_KINDS[name], head_dim, fmt.row_bytes)
    if name in TURBOQUANT_BITS:
        levels, bounds = turboquant_levels(head_dim, TURBOQUANT_BITS[name])
        desc.keep = (rotation(head_dim), levels, bounds)
        desc.rotation, desc.levels, desc.bounds = (t.data_ptr() for t in desc.keep)
    return desc


def kernels_read(fmt: KVFormat) -> bool:
    """Whether the C attention reads rows of this format (fp32 rows of any size; others in chunks of 8)."""
    return fmt.name == "float32" or fmt.head_dim % 8 == 0


class AnnaHybridLayer(ctypes.Structure):
    _fields_ = [("linear", ctypes.c_int), ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("gate_up", AnnaLinear), ("down", AnnaLinear), ("qkv", AnnaLinear), ("o", AnnaLinear),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("kv_format", ctypes.c_void_p), ("in_proj", AnnaLinear), ("ba", AnnaLinear), ("out_proj", AnnaLinear),
                ("conv_weight", ctypes.c_void_p), ("a_log", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p),
                ("gated_norm", ctypes.c_void_p), ("gated_norm_wtype", ctypes.c_int), ("conv_state", ctypes.c_void_p),
                ("recurrent_state", ctypes.c_void_p)]


class CpuKernels:
    """ctypes bindings of the kernels in csrc/. Every tensor handed in is fp32 and contiguous
    unless the method says otherwise; ``threads`` follows torch.get_num_threads()."""

    def __init__(self, library: Path, level: str = "avx2") -> None:
        self.level = level  # the kernel level it was built for (LEVEL_CFLAGS)
        self.library = library
        self.build_id = library.stem  # the level and the hash of the sources and flags
        lib = ctypes.CDLL(str(library))
        p, i, l, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
        lib.anna_gemv.argtypes = [p, p, i, p, p, i, l, l, i, i, i]
        lib.anna_gemv_experts.argtypes = [p, p, p, p, l, i, p, l, l, i, i, i]
        lib.anna_deinterleave_rows.argtypes = [p, i, l, l, p, i]
        lib.anna_deinterleave_rows16.argtypes = [p, l, l, p, i]
        lib.anna_add_rmsnorm.argtypes = [p, p, p, i, p, l, l, f, i]
        lib.anna_rotary.argtypes = [p, l, l, l, l, p, p, p]
        lib.anna_silu_mul.argtypes = [p, p, l, l, i, i]
        lib.anna_paged_decode_attention.argtypes = [p, p, p, p, p, l, p, l, l, l, l, l, l, f, p, i]
        lib.anna_kv_write.argtypes = [p, p, l, l, l, p, p, l]
        lib.anna_causal_attention.argtypes = [p, p, p, p, l, l, l, l, l, f, l, i, i]
        lib.anna_qgemm.argtypes = [p, p, p, i, l, p, p, l, l, l, i]
        lib.anna_qgemm_experts.argtypes = [p, p, p, p, p, l, i, l, p, l, l, i]
        lib.anna_dequant.argtypes = [p, p, i, l, p, l, l, l, p, i, i]
        lib.anna_decode_layers.argtypes = [ctypes.POINTER(AnnaLayer), l, p, l, l, l, l, l, l, f, p, p, p, l, p, l, l,
                                           f, p, p, p, p, i]
        lib.anna_argmax_rows.argtypes = [p, l, l, p, i]
        lib.anna_decode_hybrid_layers.argtypes = [ctypes.POINTER(AnnaHybridLayer), l, p, l, l, l, l, l, l, l, f, p, p,
                                                  p, l, p, l, f, p, p, p, p, l, l, l, l, l, p, p, i]
        lib.anna_conv_step.argtypes = [p, p, p, p, l, l, l, p, p, i]
        lib.anna_gated_delta_decode.argtypes = [p, p, p, p, p, p, p, p, p, i, f, l, l, l, l, l, p, i]
        for fn in (lib.anna_conv_step, lib.anna_gated_delta_decode, lib.anna_decode_hybrid_layers, lib.anna_gemv, lib.anna_gemv_experts, lib.anna_deinterleave_rows, lib.anna_deinterleave_rows16, lib.anna_add_rmsnorm, lib.anna_rotary, lib.anna_silu_mul,
                   lib.anna_paged_decode_attention, lib.anna_qgemm, lib.anna_qgemm_experts, lib.anna_dequant,
                   lib.anna_decode_layers, lib.anna_argmax_rows, lib.anna_kv_write, lib.anna_causal_attention):
            fn.restype = None
        if level == "avx2":  # csrc/panel_matmul.c: only the avx2 level's build has these
            lib.anna_panel_matmul.argtypes = [p, p, i, p, p, l, l, l, i]
            lib.anna_panel_gated_act.argtypes = [p, p, i, p, p, l, l, l, i]
            lib.anna_panel_matmul.restype = lib.anna_panel_gated_act.restype = None
            self.panel_kc_max = lib.anna_panel_kc_max()
        if level == "amx":  # csrc/tile_matmul.c: only the amx level's build has these
            lib.anna_tile_matmul.argtypes = [p, i, p, p, p, i, l, l, l, i]
            lib.anna_tile_gated_act.argtypes = [p, i, p, p, p, l, l, l, i]
            lib.anna_tile_matmul.restype = lib.anna_tile_gated_act.restype = None
        self.lib = lib
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # per dtype; see _matmul_operand

    @property
    def int8_dot_products(self) -> bool:
        """Whether this build multiplies int8 on vpdpbusd (the avx512_vnni level and up)."""
        return self.level in ("avx512_vnni", "amx")

    @property
    def widens_bf16_pairs(self) -> bool:
        """Whether this build's gemv can widen bf16 weights in registers (bf16_pair_max_rows: the
        avx2 level; the AVX-512 levels convert them, or multiply them on vdpbf16ps)."""
        return self.level == "avx2"

    @staticmethod
    def supports_weight(weight: torch.Tensor) -> bool:
        return (weight.dtype in WEIGHT_TYPES and weight.dim() == 2 and weight.shape[1] % 8 == 0
                and weight.is_contiguous() and weight.device.type == "cpu")

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             bf16_dot_rows: int = 0, bf16_pair_max_rows: int = 0) -> torch.Tensor:
        """y = x W^T (+ b) for a few rows of x, reading each weight row once for all of them.
        ``weight`` must be in linear.interleave_rows' layout. From ``bf16_dot_rows`` rows of x on
        (0: never), bf16 weights are multiplied by x rounded to bf16 on vdpbf16ps; up to
        ``bf16_pair_max_rows`` (AVX2 builds) they are widened in registers instead of converted
        block by block (LinearRouting)."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k).float().contiguous()
        rows, n = x2.shape[0], weight.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        b = _fp32(bias)
        self.lib.anna_gemv(x2.data_ptr(), weight.data_ptr(), WEIGHT_TYPES[weight.dtype], _ptr(b), y.data_ptr(),
                           rows, n, k, bf16_dot_rows, bf16_pair_max_rows, torch.get_num_threads())
        return y.view(*x.shape[:-1], n)

    def gemv_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, starts: torch.Tensor,
                     wtype: int, n: int, bf16_dot_rows: int = 0, bf16_pair_max_rows: int = 0) -> torch.Tensor:
        """gemv of several experts in one call: rows [starts[g], starts[g + 1]) of x [rows, K] times
        expert ids[g]'s weight, at weights[ids[g]] (an int64 table of data pointers; every expert
        [n, K] of type ``wtype`` in interleave_rows' layout, no bias)."""
        x2 = x.float().contiguous()
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        self.lib.anna_gemv_experts(x2.data_ptr(), weights.data_ptr(), ids.data_ptr(), starts.data_ptr(), ids.numel(),
                                   wtype, y.data_ptr(), n, x2.shape[1], bf16_dot_rows, bf16_pair_max_rows,
                                   torch.get_num_threads())
        return y

    def _matmul_operand(self, n: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An [n, k] buffer for a weight that one matmul reads and drops: weights up to
        UNPACK_SCRATCH_BYTES share one reused buffer per dtype (valid until the next call), because
        filling freshly allocated pages costs several times the conversion itself."""
        if n * k * dtype.itemsize > UNPACK_SCRATCH_BYTES:
            return torch.empty(n, k, dtype=dtype)
        scratch = self._scratch.get(dtype)
        if scratch is None or scratch.numel() < n * k:
            scratch = self._scratch[dtype] = torch.empty(n * k, dtype=dtype)
        return scratch[:n * k].view(n, k)

    def deinterleave(self, weight: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """Row-major copy of a weight in linear.interleave_rows' layout, for one matmul: fp32, or
        (``keep_dtype``, 16-bit weights) in the weight's own dtype."""
        n, k = weight.shape
        if keep_dtype and weight.element_size() == 2:
            out = self._matmul_operand(n, k, weight.dtype)
            self.lib.anna_deinterleave_rows16(weight.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
            return out
        out = self._matmul_operand(n, k)
        self.lib.anna_deinterleave_rows(weight.data_ptr(), WEIGHT_TYPES[weight.dtype], n, k, out.data_ptr(),
                                        torch.get_num_threads())
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits.argmax(dim=-1) of [rows, vocab] logits (any float dtype), as a long tensor."""
        x = logits.float().contiguous()
        out = torch.empty(x.shape[0], dtype=torch.long)
        self.lib.anna_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
        return out

    def qgemm(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, kind: int, group: int,
              bias: torch.Tensor | None) -> torch.Tensor:
        """y = x dequant(W)^T (+ b) from int8 (kind 0) or int4 (kind 1) weights in the layout of
        linear.quantized_for_cpu_kernel (QuantLinear.interleave_for_cpu_kernel)."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k).float().contiguous()
        rows, n = x2.shape[0], qweight.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        b = _fp32(bias)
        self.lib.anna_qgemm(x2.data_ptr(), qweight.data_ptr(), scales.data_ptr(), kind, group, _ptr(b), y.data_ptr(),
                            rows, n, k, torch.get_num_threads())
        return y.view(*x.shape[:-1], n)

    def qgemm_experts(self, x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                      starts: torch.Tensor, kind: int, group: int, n: int) -> torch.Tensor:
        """qgemm of several experts in one call: rows [starts[g], starts[g + 1]) of x [rows, K] times
        expert ids[g]'s weight, whose qweight and scales are at weights[ids[g]], scales[ids[g]]
        (int64 tables of data pointers; every expert [n, K], same kind and group, no bias)."""
        x2 = x.float().contiguous()
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        self.lib.anna_qgemm_experts(x2.data_ptr(), weights.data_ptr(), scales.data_ptr(), ids.data_ptr(),
                                    starts.data_ptr(), ids.numel(), kind, group, y.data_ptr(), n, x2.shape[1],
                                    torch.get_num_threads())
        return y

    def dequant(self, qweight: torch.Tensor, scales: torch.Tensor, kind: int, group: int, k: int,
                rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Row-major weights (fp32, or bf16 rounded from the fp32 values) of the given rows of an
        interleaved quantized weight: all rows (for one matmul, see _matmul_operand) when None."""
        n = qweight.shape[0]
        if rows is None:
            count, idx, out = n, None, self._matmul_operand(n, k, dtype)
        else:
            idx = rows.to(torch.long).reshape(-1).contiguous()
            count = idx.numel()
            out = torch.empty(count, k, dtype=dtype)
        self.lib.anna_dequant(qweight.data_ptr(), scales.data_ptr(), kind, group, _ptr(idx), count, n, k,
                              out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())
        return out

    def decode_layers(self, layers: ctypes.Array, embeddings: torch.Tensor, *, heads: int, kv_heads: int,
                      head_dim: int, intermediate: int, eps: float, positions: torch.Tensor, slots: torch.Tensor,
                      tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int | None,
                      scale: float, cos_table: torch.Tensor, sin_table: torch.Tensor,
                      final_norm: torch.Tensor) -> torch.Tensor:
        """Every decoder layer for a decode-only batch; returns the final normed hidden states."""
        m, hidden = embeddings.shape
        out = torch.empty_like(embeddings)
        self.lib.anna_decode_layers(
            layers, len(layers), embeddings.data_ptr(), m, hidden, heads, kv_heads, head_dim, intermediate, eps,
            positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], context_lens.data_ptr(),
            block_size, window or 0, scale, cos_table.data_ptr(), sin_table.data_ptr(), final_norm.data_ptr(),
            out.data_ptr(), torch.get_num_threads())
        return out

    def decode_hybrid_layers(self, layers: ctypes.Array, embeddings: torch.Tensor, *, heads: int, kv_heads: int,
                             head_dim: int, rope_dim: int, intermediate: int, eps: float, positions: torch.Tensor,
                             slots: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                             scale: float, cos_table: torch.Tensor, sin_table: torch.Tensor,
                             state_slots: torch.Tensor, state_src_slots: torch.Tensor | None, key_heads: int,
                             value_heads: int, key_dim: int, value_dim: int, conv_kernel: int,
                             final_norm: torch.Tensor) -> torch.Tensor:
        """Every layer of a hybrid model (csrc/decode_hybrid.c) for a decode-only batch; returns the
        final normed hidden states. ``state_src_slots``: where each row's state comes from (None:
        its own slot; see conv_step)."""
        m, hidden = embeddings.shape
        out = torch.empty_like(embeddings)
        self.lib.anna_decode_hybrid_layers(
            layers, len(layers), embeddings.data_ptr(), m, hidden, heads, kv_heads, head_dim, rope_dim, intermediate,
            eps, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], context_lens.data_ptr(),
            block_size, scale, cos_table.data_ptr(), sin_table.data_ptr(), state_slots.data_ptr(),
            _ptr(state_src_slots), key_heads,
            value_heads, key_dim, value_dim, conv_kernel, final_norm.data_ptr(), out.data_ptr(),
            torch.get_num_threads())
        return out

    def add_rmsnorm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
        """x += delta (in place, when given); return rmsnorm(x) * weight."""
        out = torch.empty_like(x)
        dim = x.shape[-1]
        self.lib.anna_add_rmsnorm(x.data_ptr(), _ptr(delta), weight.data_ptr(), WEIGHT_TYPES[weight.dtype],
                                  out.data_ptr(), x.numel() // dim, dim, eps, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up for rows laid out [gate | up] (the fused gate_up matmul's output): bf16
        rows give bf16 (computed in fp32), any other dtype fp32; into ``out`` (contiguous, of that
        dtype and shape) where given."""
        width = gate_up.shape[-1] // 2
        bf16 = gate_up.dtype == torch.bfloat16
        rows = gate_up.contiguous() if bf16 else gate_up.float().contiguous()
        if out is None:
            out = torch.empty(*gate_up.shape[:-1], width, dtype=rows.dtype)
        self.lib.anna_silu_mul(rows.data_ptr(), out.data_ptr(), rows.numel() // (2 * width), width, int(bf16),
                               torch.get_num_threads())
        return out

    def rotary(self, x: torch.Tensor, heads: int, head_dim: int, cos_table: torch.Tensor, sin_table: torch.Tensor,
               positions: torch.Tensor) -> None:
        """Rotate ``heads`` heads at the start of each row of the 2-D view ``x``, in place."""
        self.lib.anna_rotary(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos_table.data_ptr(),
                             sin_table.data_ptr(), positions.data_ptr())

    def conv_step(self, x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                  src_slots: torch.Tensor | None = None) -> torch.Tensor:
        """silu(causal conv) of one token per row of x [B, C], updating the rows' conv states
        (conv_state [slots, K - 1, C], weight [K, C], both fp32) in place. ``src_slots``: row b
        starts from that slot's state (None: its own), taken in row order, so rows may chain."""
        x2 = x.float().contiguous()
        out = torch.empty_like(x2)
        batch, channels = x2.shape
        self.lib.anna_conv_step(x2.data_ptr(), conv_state.data_ptr(), slots.contiguous().data_ptr(),
                                _ptr(None if src_slots is None else src_slots.contiguous()), batch, channels,
                                weight.shape[0], weight.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    def gated_delta_decode(self, conved: torch.Tensor, z: torch.Tensor, ba: torch.Tensor, state: torch.Tensor,
                           slots: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, key_heads: int, src_slots: torch.Tensor | None = None) -> torch.Tensor:
        """A Gated DeltaNet layer's decode after its conv (csrc/gated_delta.c): conved [B, q | k | v],
        z [B, heads * dv], ba [B, b | a] (fp32), state [slots, heads, dk, dv] updated in place;
        returns the gated-norm output [B, heads * dv]. ``src_slots``: as for conv_step."""
        conved, z, ba = (t.float().contiguous() for t in (conved, z, ba))
        _, heads, dk, dv = state.shape
        out = torch.empty(conved.shape[0], heads * dv, dtype=torch.float32)
        self.lib.anna_gated_delta_decode(
            conved.data_ptr(), z.data_ptr(), ba.data_ptr(), state.data_ptr(), slots.contiguous().data_ptr(),
            _ptr(None if src_slots is None else src_slots.contiguous()), a_log.data_ptr(), dt_bias.data_ptr(), norm_weight.data_ptr(), WEIGHT_TYPES[norm_weight.dtype], eps,
            conved.shape[0], key_heads, heads, dk, dv, out.data_ptr(), torch.get_num_threads())
        return out

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fmt: KVFormat,
                         tables: torch.Tensor, context_lens: torch.Tensor, window: int | None,
                         scale: float) -> torch.Tensor:
        """Paged decode attention over caches whose rows are stored as ``fmt`` (kernels_read)."""
        seqs, heads, dim = q.shape
        blocks, kv_heads, block_size, _ = k_cache.shape
        out = torch.empty_like(q)
        self.lib.anna_paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), ctypes.byref(kv_format_descriptor(fmt)),
            tables.data_ptr(), tables.shape[1], context_lens.data_ptr(), seqs, heads, kv_heads, dim, block_size,
            window or 0, scale, out.data_ptr(), torch.get_num_threads())
        return out

    def tile_attention(self, head_dim: int) -> bool:
        """Whether bf16 prompt attention of this head size runs on AMX tiles (the amx level's build;
        csrc/prefill_attention.c): D a multiple of 32, at most 256."""
        return self.level == "amx" and head_dim % 32 == 0 and head_dim <= 256

    def tile_matmul_fits(self, weight: torch.Tensor) -> bool:
        """Whether a large-M matmul of this weight (in interleave_rows' layout) runs on AMX tiles
        (the amx level's build; csrc/tile_matmul.c): bf16, N and K multiples of 32 (so a gated
        MLP's [gate | up] weight has halves of a multiple of 16, as tile_gated_act needs)."""
        n, k = weight.shape
        return self.level == "amx" and weight.dtype == torch.bfloat16 and n % 32 == 0 and k % 32 == 0

    def tile_matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x W^T (+ b) on AMX tiles for a weight that ``tile_matmul_fits``: x (fp32 or bf16) rounded to
        bf16 (as a bf16 GEMM takes it), the sums fp32, the result ``out_dtype`` (fp32 or bf16)."""
        x2, b, n = self._tile_operand(x), _fp32(bias), weight.shape[0]
        y = torch.empty(x2.shape[0], n, dtype=out_dtype)
        self.lib.anna_tile_matmul(x2.data_ptr(), int(x2.dtype == torch.float32), weight.data_ptr(), _ptr(b),
                                  y.data_ptr(), int(out_dtype == torch.bfloat16), x2.shape[0], n, x2.shape[1],
                                  torch.get_num_threads())
        return y.view(*x.shape[:-1], n)

    def tile_gated_act(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of a gated MLP, [gate | up] = x W^T (+ b), on AMX tiles (W the [2I, K]
        gate_up weight, which ``tile_matmul_fits``), into ``out`` (bf16 [rows, I]) or a new
        bf16 tensor: the gate and up rows never leave the kernel."""
        x2, b, i = self._tile_operand(x), _fp32(bias), weight.shape[0] // 2
        if out is None:
            out = torch.empty(x2.shape[0], i, dtype=torch.bfloat16)
        self.lib.anna_tile_gated_act(x2.data_ptr(), int(x2.dtype == torch.float32), weight.data_ptr(), _ptr(b),
                                     out.data_ptr(), x2.shape[0], i, x2.shape[1], torch.get_num_threads())
        return out

    def panel_matmul_fits(self, weight: torch.Tensor, gated: bool = False) -> bool:
        """Whether a large-M matmul of this weight (in interleave_rows' layout) runs on the avx2
        level's register-blocked GEMM (csrc/panel_matmul.c): any float weight the kernels take;
        ``gated``: a gated MLP's [gate | up] weight, whose halves are whole blocks of 4 rows and
        whose K is one chunk."""
        n, k = weight.shape
        return (self.level == "avx2" and self.supports_weight(weight)
                and (not gated or (n % 8 == 0 and k <= self.panel_kc_max)))

    def panel_matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ b) in fp32 for a weight that ``panel_matmul_fits``: the weight's values widened
        to fp32, fp32 products and sums, as torch's fp32 GEMM of the same values."""
        x2, b, n = x.reshape(-1, x.shape[-1]).float().contiguous(), _fp32(bias), weight.shape[0]
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        self.lib.anna_panel_matmul(x2.data_ptr(), weight.data_ptr(), WEIGHT_TYPES[weight.dtype], _ptr(b), y.data_ptr(),
                                   x2.shape[0], n, x2.shape[1], torch.get_num_threads())
        return y.view(*x.shape[:-1], n)

    def panel_gated_act(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of a gated MLP, [gate | up] = x W^T (+ b) (W the [2I, K] gate_up weight,
        which ``panel_matmul_fits(gated=True)``), into ``out`` (fp32 [rows, I]) or a new tensor: the
        gate and up rows never leave the kernel."""
        x2, b, i = x.reshape(-1, x.shape[-1]).float().contiguous(), _fp32(bias), weight.shape[0] // 2
        if out is None:
            out = torch.empty(x2.shape[0], i, dtype=torch.float32)
        self.lib.anna_panel_gated_act(x2.data_ptr(), weight.data_ptr(), WEIGHT_TYPES[weight.dtype], _ptr(b),
                                      out.data_ptr(), x2.shape[0], i, x2.shape[1], torch.get_num_threads())
        return out

    @staticmethod
    def _tile_operand(x: torch.Tensor) -> torch.Tensor:
        """x as [rows, K], fp32 or bf16 (the kernels round fp32 to bf16 as they read it)."""
        x = x.reshape(-1, x.shape[-1])
        return (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         window: int | None = None, bf16: bool = False) -> torch.Tensor:
        """Causal attention of the last Tq of Tk positions over all of them (csrc/prefill_attention.c):
        q [Tq, H, D], k, v [Tk, KV, D] -> fp32 [Tq, H, D]; D a multiple of 8. ``window``: each
        query sees only its last ``window`` keys. ``bf16``: both products in bf16, on AMX tiles
        where ``tile_attention`` says so, else on vdpbf16ps (only on a CPU with AVX512-BF16; the avx2
        build, or D not a multiple of 16 or over 256, runs fp32)."""
        q, k, v = (t.float().contiguous() for t in (q, k, v))
        tokens, heads, dim = q.shape
        out = torch.empty_like(q)
        self.lib.anna_causal_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), tokens, k.shape[0],
                                       heads, k.shape[1], dim, scale, window or 0, int(bf16),
                                       torch.get_num_threads())
        return out

    def kv_write(self, fmt: KVFormat, rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """cache at ``slots`` = rows [len(slots), kv_heads, head_dim] (fp32), stored as ``fmt``."""
        rows = rows.float().contiguous()
        tokens, kv_heads, dim = rows.shape
        self.lib.anna_kv_write(ctypes.byref(kv_format_descriptor(fmt)), rows.data_ptr(), kv_heads * dim, tokens,
                               kv_heads, cache.data_ptr(), slots.contiguous().data_ptr(), cache.shape[2])


def kernel_build_level(isa: CpuIsa) -> str | None:
    """The highest level the kernels are built for that ``isa`` runs at, or None below AVX2."""
    built = [level for level in LEVEL_CFLAGS if isa.has(level)]
    return built[-1] if built else None


def _compile_and_link(compiler: str, flags: list[str], library: Path, sources: list[Path]) -> None:
    """Each source to an object file in its own compiler process, as many at once as there are CPUs,
    then one shared library, moved into place atomically (another process may be building it too)."""
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        objects = [Path(tmp) / (source.stem + ".o") for source in sources]

        def compile_one(source: Path, obj: Path) -> None:
            subprocess.run([compiler, *flags, "-c", "-o", str(obj), str(source)], check=True, capture_output=True,
                           text=True)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for done in [pool.submit(compile_one, s, o) for s, o in zip(sources, objects)]:
                done.result()
        linked = Path(tmp) / library.name
        subprocess.run([compiler, *flags, "-shared", "-o", str(linked), *map(str, objects)], check=True,
                       capture_output=True, text=True)
        os.replace(linked, library)


def build_cpu_kernels(cache_dir: str | Path, compiler: str = "", isa: CpuIsa | None = None) -> CpuKernels | None:
    """Compile (once per level and source version, with ``compiler`` or else cc or gcc) and load
    the kernels; None if this machine cannot (``isa``: the level Anna runs at; by default the CPU's own)."""
    level = kernel_build_level(isa or detect_isa())
    if level is None:
        log.warning("CPU without AVX2/FMA/F16C (or --cpu-isa none): using torch's matmul kernels")
        return None
    if level == "amx" and (refused := request_amx_tiles()):
        log.warning("Linux did not let Anna use the AMX tiles (%s): running the avx512_vnni level's kernels",
                    os.strerror(refused))
        level = "avx512_vnni"
    kernels = load_kernels(cache_dir, compiler, level, LEVEL_CFLAGS[level])
    if level == "amx":
        why = "could not be built" if kernels is None else amx_self_check(kernels.library)
        if why:  # (not built: a compiler without -mamx-tile, GCC before 11 or Clang before 12)
            log.warning("The amx level's kernels %s: running the avx512_vnni level's", why)
            kernels = load_kernels(cache_dir, compiler, "avx512_vnni", LEVEL_CFLAGS["avx512_vnni"])
    return kernels


def amx_self_check(library: Path, timeout_s: float = 60.0) -> str:
    """Run the amx build's self-check (csrc/quant_kernels.c: its tiles against the lanes on fixed
    data) in a child process, where a fault cannot take the server down: '' when it passes, else
    what went wrong, worded to follow "The amx level's kernels"."""
    code = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).anna_amx_self_check() & 0xFF)"
    try:
        done = subprocess.run([sys.executable, "-c", code, str(library)], capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"did not finish their self-check in {timeout_s:.0f} s"
    if done.returncode == 0:
        return ""
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:  # a real-time signal has no name
            name = f"signal {-done.returncode}"
        return f"died of {name} in their self-check"
    if done.returncode == 0xFF:
        return "were refused the tiles by Linux in their self-check"
    if done.stderr:  # the library could not be loaded or has no self-check
        return f"could not run their self-check ({done.stderr.decode(errors='replace').strip().splitlines()[-1]})"
    return f"gave {done.returncode} outputs unlike the avx512_vnni path's in their self-check"


# Linux (5.16 on) enables AMX's tile data per process on request, arch_prctl(ARCH_REQ_XCOMP_PERM,
# XFEATURE_XTILEDATA); a tile instruction before that raises SIGILL. x86-64 numbers.
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def request_amx_tiles() -> int:
    """Ask Linux to let this process (all its threads) use the AMX tiles: 0 when granted, else
    the errno (EOPNOTSUPP on a CPU without them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long  # syscall(2) is variadic over longs: pass them as such
    args = (ctypes.c_long(n) for n in (SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))
    if libc.syscall(*args) == 0:
        return 0
    return ctypes.get_errno() or -1


def load_kernels(cache_dir: str | Path, compiler: str, level: str, flags: list[str],
                 name: str | None = None, source_dir: Path = KERNEL_DIR) -> CpuKernels | None:
    """The kernels built with ``flags`` for ``level`` (compiled on first use, kept under
    ``cache_dir``/kernels by ``name``, the level's by default, and a hash of sources and flags).
    ``source_dir``: where csrc/'s files are (another revision's, for benchmarks/kernel_ab.py)."""
    flags = CFLAGS + flags
    compiler = shutil.which(compiler or "cc") or shutil.which("gcc")
    sources = [source_dir / path.name for path in SOURCES]
    text = b"".join(path.read_bytes() for path in sources + [source_dir / path.name for path in HEADERS])
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = Path(cache_dir).expanduser() / "kernels"
    library = out_dir / f"anna_cpu_kernels_{name or level}_{digest}.so"
    if not library.exists():
        if compiler is None:
            log.warning("No C compiler found: using torch's matmul kernels (install gcc for faster CPU decode)")
            return None
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            _compile_and_link(compiler, flags, library, sources)
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            log.warning("Could not compile Anna's CPU kernels (%s): using torch's", detail.strip()[:200])
            return None
    try:
        return CpuKernels(library, level)
    except OSError as exc:
        log.warning("Could not load Anna's CPU kernels (%s): using torch's", exc)
        return None
