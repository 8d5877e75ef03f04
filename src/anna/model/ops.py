"""The ops a model's layers run, chosen once when the model is built.

Every layer holds the model's ``ModelOps`` and calls it for what differs between devices: its
matmul, norms, rotary, the gated activation, decode attention, the greedy argmax. The platform
picks the class when it builds the model (platforms/), so no forward pass asks which device it
runs on. This module holds torch's implementations, which run anywhere; the CPU platform's
subclasses (platforms/cpu/ops.py) route to Anna's C kernels.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager

import torch
import torch.nn.functional as F

from anna.model.quantization import dequantize_int4, dequantize_int8

if TYPE_CHECKING:
    from anna.model.attention import AttentionMetadata, PagedKV
    from anna.model.layers import RopeBatch
    from anna.runtime.profiler import RuntimeProfiler


@dataclass(frozen=True)
class QuantFormat:
    """How linear layers are built: dense, or quantized at load time (model/quantization.py)."""

    method: str = "none"  # none | int8 | int4
    int4_group_size: int = 32
    # the lm_head's own method where the checkpoint decides it ("": the same as the layers'): a
    # GPTQ/AWQ checkpoint keeps it in floats, a GGUF file often in more bits than its layers
    lm_head_method: str = ""
    int8_group_size: int = 0  # 0: one scale per row

    def group_size(self, method: str) -> int:
        """Input columns per scale of a layer quantized as ``method`` (int8: 0 = one per row)."""
        return self.int4_group_size if method == "int4" else self.int8_group_size if method == "int8" else 0


@dataclass(frozen=True)
class LinearRouting:
    """Which kernel serves a matmul of M rows, and a prompt's attention over T tokens (measured
    per machine; see docs/tuning.md)."""

    gemv_max_rows: int = 128  # Anna's CPU kernels: largest M of the weight-streaming kernel
    upcast_min_rows: int = 8  # CPU without Anna's kernels: from this M on, half matmuls run in fp32
    int4_matmul: str = "auto"  # auto | packed | dequant
    int4_gemv_m_threshold: int = 2048  # auto: the packed int4 kernel for M <= this
    # CPU, a bf16 model on hardware bf16 (AVX512-BF16 or AMX, platforms/cpu/isa.py): matmuls beyond
    # the weight-streaming and packed kernels run in bf16 (dense weights as they are, quantized ones
    # dequantized to bf16) instead of in fp32
    bf16_matmul: bool = False
    # ... and from this M on, the weight-streaming kernel multiplies bf16 weights by x rounded to bf16
    # on vdpbf16ps (0: never; only where bf16_matmul, whose CPUs have the instruction)
    bf16_dot_rows: int = 0
    # ... and on AVX2 (no bf16 arithmetic), from 4 up to this M it widens bf16 weights in registers
    # (shift and mask) instead of converting each block to fp32 once for all rows of x (0: never)
    bf16_pair_max_rows: int = 32
    # CPU: a gated MLP of more rows runs in tiles of this many (0: whole), so that its wide
    # intermediate rows stay in cache between its two matmuls
    mlp_tile_rows: int = 256
    # CPU with Anna's kernels: a prompt chunk attending over a context of at least this many tokens
    # runs torch's SDPA (in attention_dtype; oneDNN's AMX tiles for bf16 where the CPU has them)
    # instead of Anna's prefill attention kernel (0: never)
    sdpa_min_tokens: int = 0
    # CPU with Anna's kernels: the packed int8 kernel for M <= this, the dequantized GEMM above
    int8_gemv_m_threshold: int = 2048


class ModelOps:
    """torch's ops: what CUDA and XPU run, and the base the CPU platform builds on."""

    kernels: Any = None  # Anna's CPU kernels (platforms/cpu/kernels.py), where they serve
    attention_dtype: torch.dtype | None = None  # batched attention matmuls in this dtype; None: the input's

    def __init__(self, quant: QuantFormat = QuantFormat(), routing: LinearRouting = LinearRouting(),
                 profiler: "RuntimeProfiler | None" = None) -> None:
        self.quant = quant
        self.routing = routing
        self.profiler = profiler

    def region(self, name: str) -> ContextManager:
        """A --profile-runtime region, or nothing."""
        return nullcontext() if self.profiler is None else self.profiler.region(name)

    # ---- weights ----
    def keeps_kernel_layout(self, weight: torch.Tensor) -> bool:
        """Whether this dense weight is stored in a kernel's own layout after loading."""
        return False

    def streams_weight(self, layer: Any, rows: int) -> bool:
        """Whether a matmul of ``rows`` rows runs Anna's weight-streaming kernel (dense layers)."""
        return False

    def reads_packed(self, layer: Any, rows: int) -> bool:
        """Whether a matmul of ``rows`` rows reads the quantized weight directly (QuantLinear)."""
        return False

    # ---- matmuls ----
    def linear(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        with self.region(layer.profile_name or "matmul:torch"):
            return F.linear(x, layer.weight, layer.bias)

    def dequantize(self, layer: Any, rows: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Row-major weights of a QuantLinear (of the given rows): fp32, or rounded from it to ``dtype``."""
        q = layer.qweight if rows is None else layer.qweight[rows]
        s = layer.scales if rows is None else layer.scales[rows]
        w = dequantize_int8(q, s, layer.group) if layer.kind == 0 else dequantize_int4(q, s, layer.group)
        return w.to(dtype)

    def quant_linear(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        fmt = "int8" if layer.kind == 0 else "int4"
        with self.region("dequantize"):
            w = self.dequantize(layer).to(x.dtype)
        with self.region(layer.profile_name or f"matmul:{fmt}_dequant_gemm"):
            return F.linear(x, w, None if layer.bias is None else layer.bias.to(x.dtype))

    def gated_mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of a GatedMLP: one op, so that a platform can keep the wide
        intermediate rows in its matmul dtype."""
        return mlp.down_proj(self.silu_mul(mlp.gate_up_proj(x)))

    # ---- elementwise ----
    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual stream: residual += x, return (norm(residual), residual)."""
        with self.region("rmsnorm"):
            if residual is None:
                return rms_norm(x, weight, eps)
            residual = residual + x
            return rms_norm(residual, weight, eps), residual

    def rotary(self, q: torch.Tensor, k: torch.Tensor, rope: "RopeBatch", heads: int, kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, heads * D] and k [T, kv_heads * D]; return them as [T, heads, D]."""
        t = q.shape[0]
        with self.region("rotary"):
            return (apply_rotary(q.view(t, heads, head_dim), rope.cos, rope.sin),
                    apply_rotary(k.view(t, kv_heads, head_dim), rope.cos, rope.sin))

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up for rows laid out [gate | up] (into ``out``, where given)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.mul(F.silu(gate), up, out=out)

    # ---- attention and sampling ----
    def write_kv(self, cache: "PagedKV", k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """The new tokens' k, v [T, KV, D] into the cache at ``slots``, in its format."""
        from anna.model.attention import write_kv

        write_kv(cache, k, v, slots)

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """A prompt chunk's causal attention over its context: q [Tq, H, D] are the last Tq of the
        Tk positions whose k, v [Tk, KV, D] are given (Tq = Tk: a prompt over itself; fewer: a chunk
        after a cached prefix) -> [Tq, H, D], computed in attention_dtype. ``mask``: that causal mask
        [Tq, Tk], from the step's metadata, the sliding window in it; needed where Tq < Tk (SDPA's
        is_causal would align query 0 with key 0) or where the window cuts the context. ``window``:
        the sliding window itself, for kernels that take it instead of the mask."""
        from anna.model.attention import sdpa_attention

        return sdpa_attention(q, k, v, scale, mask, self.attention_dtype or q.dtype)

    def decode_attention(self, q: torch.Tensor, cache: "PagedKV", meta: "AttentionMetadata", scale: float,
                         sliding_window: int | None) -> torch.Tensor:
        from anna.model.attention import torch_decode_attention

        return torch_decode_attention(q, cache, meta, scale, self.attention_dtype or q.dtype)

    # ---- linear attention (model/gated_delta.py) ----
    def conv_step(self, x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                  src_slots: torch.Tensor | None = None) -> torch.Tensor:
        """silu(causal conv) of one new token per row, updating the rows' conv states. ``src_slots``:
        row b starts from that slot's state instead of its own, rows taken in order, so that a row
        may continue the one before it (speculative decoding's verification)."""
        from anna.model.gated_delta import conv_step, in_row_order

        if src_slots is None:
            return conv_step(x, conv_state, slots, weight)
        return in_row_order(lambda r, s: conv_step(x[r], conv_state, s, weight), [conv_state], slots, src_slots)

    def gated_delta_decode(self, layer: Any, conved: torch.Tensor, z: torch.Tensor, ba: torch.Tensor,
                           state: torch.Tensor, slots: torch.Tensor, src_slots: torch.Tensor | None = None) -> torch.Tensor:
        """A Gated DeltaNet layer's decode after its conv, one token per row: the gates, one step
        of the delta rule (updating the rows' states), the gated norm. ``src_slots``: as for
        conv_step."""
        from anna.model.gated_delta import decode_after_conv, in_row_order

        if src_slots is None:
            return decode_after_conv(layer, conved, z, ba, state, slots)
        return in_row_order(lambda r, s: decode_after_conv(layer, conved[r], z[r], ba[r], state, s), [state], slots,
                            src_slots)

    def grouped_experts(self, moe: Any, rows: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """Every chosen expert over its rows (grouped by expert, ``counts`` each) in one call per
        projection, where a kernel does that; None: the MoE layer runs them one by one."""
        return None

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != x.dtype:  # an fp32 weight (zero-centred norms): scale in fp32, as transformers does
        return (xf * weight.float()).to(x.dtype)
    return weight * xf.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


TORCH_OPS = ModelOps()  # for layers built outside an engine (tests, tools)
