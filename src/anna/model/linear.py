"""Linear layers and the weight layouts Anna's CPU kernels read. Which kernel runs a matmul is
the ops' choice (model/ops.py; on CPU platforms/cpu/ops.py), routed by M (rows of x).

On CPU, decode-sized matmuls (M <= ``cpu_gemv_max_rows``) go to Anna's weight-streaming kernel,
which reads each weight row once for all rows of x. Larger half-precision matmuls are upcast to
fp32: torch's bf16/fp16 GEMM on CPUs without native half-precision matrix instructions is
several times slower than its fp32 GEMM. benchmarks/matmul_routing.py measures the crossovers.

When Anna's kernels serve a layer, its weight is stored with rows interleaved (``interleave_rows``):
blocks of 4 rows whose columns alternate in chunks of 8 values, so that the kernel streams one
contiguous block instead of four short rows (about 20% more memory bandwidth at K = 896 on a
2-core Zen 3). Quantized weights go one step further (``int4_row_lanes``, ``int8_row_lanes``):
blocks of 8 rows with one row per 32-bit lane, which lets the kernel's integer dot products serve
8 rows (16 with AVX-512) per instruction without horizontal sums, in pairs whose vectors
alternate so that the kernel reads one contiguous stream.
"""

from __future__ import annotations

import torch
from torch import nn

from anna.model.ops import TORCH_OPS, ModelOps
from anna.model.quantization import INT4_BLOCK, PackedWeight, dense, quantize_int4, quantize_int8, unpack_int4


PACK_ROWS, PACK_COLS = 4, 8  # cpu_kernels.c's block: 4 rows, columns in chunks of 8 values
LANE_ROWS = 8  # quant_kernels.c's int4 block: 8 rows, one per 32-bit lane
LANE_BYTES = 32  # one vector of an int4 block's run of 32 columns (8 rows x 4 bytes)


def interleave_rows(weight: torch.Tensor, chunk: int = PACK_COLS, rows: int = PACK_ROWS) -> torch.Tensor:
    """[N, C] row-major -> the kernels' layout: for each block of ``rows`` rows, C/chunk chunks of
    (rows x chunk columns); the last N % rows rows stay row-major at the end. Same shape, dtype
    and values."""
    n, c = weight.shape
    full = n - n % rows
    out = torch.empty_like(weight)
    out[:full].view(full // rows, c // chunk, rows, chunk).copy_(
        weight[:full].view(full // rows, rows, c // chunk, chunk).transpose(1, 2))
    out[full:] = weight[full:]
    return out


def int4_row_lanes(qweight: torch.Tensor) -> torch.Tensor:
    """Packed int4 [N, K/2] (quantization.py's row-major runs) -> quant_kernels.c's "row lanes":
    per block of 8 rows and run of 32 columns k0.., 4 vectors of 32 bytes, byte 4j + i of vector l
    holding row j's weights k0 + 4l + i (low nibble) and k0 + 16 + 4l + i (high nibble); blocks
    in pairs whose vectors alternate (``pair_blocks``). The last N % 8 rows stay as they are."""
    n, half = qweight.shape
    k, full = half * 2, n - n % LANE_ROWS
    out = qweight.clone()
    step = LANE_ROWS * 1024  # rows per pass: the unpacked copy is 1 byte a weight, so go in slices
    for start in range(0, full, step):
        rows = min(step, full - start)
        q = unpack_int4(qweight[start:start + rows]).view(rows // LANE_ROWS, LANE_ROWS, k // INT4_BLOCK, 2, 4, 4)
        lanes = q.permute(0, 2, 4, 1, 5, 3)  # [block, run, l, row j, i, low/high]
        out[start:start + rows] = (lanes[..., 0] | (lanes[..., 1] << 4)).reshape(rows, half)
    return pair_blocks(out, LANE_BYTES)


def int8_row_lanes(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] row-major -> quant_kernels.c's row lanes: per block of 8 rows and run of 32
    columns k0.., 8 vectors of 32 bytes, byte 4j + i of vector l holding row j's weight k0 + 4l + i;
    blocks in pairs whose vectors alternate (``pair_blocks``). The last N % 8 rows stay as they are."""
    n, k = qweight.shape
    full = n - n % LANE_ROWS
    out = qweight.clone()
    step = LANE_ROWS * 1024  # rows per pass, so that the lm_head's copy is not made whole at once
    for start in range(0, full, step):
        rows = min(step, full - start)
        lanes = qweight[start:start + rows].view(rows // LANE_ROWS, LANE_ROWS, k // INT4_BLOCK, 8, 4)
        out[start:start + rows] = lanes.permute(0, 2, 3, 1, 4).reshape(rows, k)  # [block, run, l, row j, i]
    return pair_blocks(out, LANE_BYTES)


def pair_blocks(blocked: torch.Tensor, chunk: int) -> torch.Tensor:
    """Rows in blocks of LANE_ROWS, each block's values in chunks of ``chunk`` -> pairs of blocks
    whose chunks alternate (the first block's chunk 0, the second's, then chunk 1 of each, ...), as
    quant_kernels.c reads a unit of 16 rows; an odd last block and the N % 8 rows after it stay.
    In place (the callers hand it a layout they just built), returned."""
    n, c = blocked.shape
    full = n - n % LANE_ROWS
    per_block = blocked[:full].reshape(full // LANE_ROWS, LANE_ROWS * c)
    blocked[:full] = interleave_rows(per_block, chunk, 2).view(full, c)
    return blocked


def quantized_for_cpu_kernel(kind: int, qweight: torch.Tensor,
                             scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and scales (row-major, as quantized) in the layout quant_kernels.c reads: int8
    (kind 0) and int4 (kind 1) values in row lanes; group scales in blocks of 8 rows alternating
    every group, paired as the values are (int8's row scales, one per row, stay as they are)."""
    values = int8_row_lanes(qweight) if kind == 0 else int4_row_lanes(qweight)
    if scales.dim() == 1:  # int8's row scales
        return values, scales
    return values, pair_blocks(interleave_rows(scales, 1, LANE_ROWS), LANE_ROWS)


def gather_interleaved_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of an interleaved weight, row-major, shaped [*rows.shape, K] (embedding lookups)."""
    n, k = packed.shape
    full = n - n % PACK_ROWS
    blocks = packed[:full].view(full // PACK_ROWS, k // PACK_COLS, PACK_ROWS, PACK_COLS)
    flat = rows.reshape(-1).long()
    if full == n:  # no tail rows (every real vocabulary and layer size): one gather
        return blocks[flat // PACK_ROWS, :, flat % PACK_ROWS].reshape(*rows.shape, k)
    out = packed.new_empty(flat.numel(), k)
    in_blocks = flat < full
    if in_blocks.any():
        r = flat[in_blocks]
        out[in_blocks] = blocks[r // PACK_ROWS, :, r % PACK_ROWS].reshape(-1, k)
    if not in_blocks.all():  # rows of the row-major tail
        out[~in_blocks] = packed[flat[~in_blocks]]
    return out.view(*rows.shape, k)


class Linear(nn.Module):
    """y = x W^T + b, where W may stack several checkpoint tensors along the output dim
    (q/k/v, gate/up) so that one matmul serves them all."""

    def __init__(self, in_features: int, out_features: int | list[int], *, bias: bool, dtype: torch.dtype,
                 ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        self.in_features = in_features
        self.out_features = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        self.ops = ops
        self.profile_name: str | None = None  # region name under --profile-runtime (default: the route)
        self.interleaved = False  # weight in interleave_rows' layout, for Anna's CPU kernel
        self.tensor_parallel = None  # parallel/sharding.py's LinearShard: what this rank keeps of the checkpoint

    def shard_slice(self, shard: int) -> slice:
        start = sum(self.shard_sizes[:shard])
        return slice(start, start + self.shard_sizes[shard])

    def load(self, kind: str, shard: int, tensor: torch.Tensor, name: str, where: str) -> None:
        """Copy one checkpoint tensor (a weight or bias shard) into place."""
        param = self.weight if kind == "weight" else self.bias
        dest = param.data[self.shard_slice(shard)]
        check_shape(name, where, tuple(dest.shape), tuple(tensor.shape))
        dest.copy_(dense(tensor))

    def interleave_for_cpu_kernel(self, converted: bool = False) -> None:
        """Store the weight in the layout Anna's CPU kernel reads (once, after loading; ``converted``:
        it already is, read back from a cache of the loaded state). A tied embedding shares this
        tensor: it reads its rows with ``weight_rows``."""
        if self.interleaved or not self.ops.keeps_kernel_layout(self.weight):
            return
        if not converted:
            self.weight.data = interleave_rows(self.weight.data)
        self.interleaved = True

    def uses_gemv_kernel(self, rows: int) -> bool:
        """Whether a CPU matmul of this many rows of x runs Anna's weight-streaming kernel."""
        return self.ops.streams_weight(self, rows)

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the weight, row-major, whatever its layout (embedding lookups of a tied lm_head)."""
        return gather_interleaved_rows(self.weight, rows) if self.interleaved else self.weight[rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self, x)


def check_shape(name: str, where: str, expected: tuple, got: tuple) -> None:
    if expected != got:
        from anna.model.config import ModelLoadError
        raise ModelLoadError(f"{where}: tensor '{name}' has shape {list(got)}, but config.json implies {list(expected)}")


class QuantLinear(nn.Module):
    """A Linear whose weight is quantized at load time, shard by shard (see quantization.py).

    Execution on CPU with Anna's kernels: the packed kernel reads int8/int4 directly (for int4,
    when M <= ``int4_gemv_m_threshold`` under ``int4_matmul=auto``); otherwise the weight is
    dequantized to fp32 and a dense GEMM runs. Without Anna's kernels, or on other devices,
    always the dequantized path (the ops decide: model/ops.py, platforms/cpu/ops.py).
    """

    def __init__(self, in_features: int, out_features: int | list[int], *, bias: bool, dtype: torch.dtype,
                 ops: ModelOps, method: str = "") -> None:
        super().__init__()
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        self.in_features = in_features
        self.out_features = n = sum(self.shard_sizes)
        self.method = method or ops.quant.method
        self.kind = 0 if self.method == "int8" else 1
        self.group = ops.quant.group_size(self.method)
        if self.group and in_features % self.group:
            raise ValueError(f"{self.method}_group_size: {self.group} does not divide the input size {in_features}")
        if in_features % INT4_BLOCK:
            raise ValueError(f"quantization: input size {in_features} is not a multiple of {INT4_BLOCK}")
        if self.kind == 0:
            self.register_buffer("qweight", torch.zeros(n, in_features, dtype=torch.int8))
            self.register_buffer("scales", torch.zeros(n, dtype=torch.float32) if not self.group else
                                 torch.zeros(n, in_features // self.group, dtype=torch.float16))
        else:
            self.register_buffer("qweight", torch.zeros(n, in_features // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.zeros(n, in_features // self.group, dtype=torch.float16))
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype), requires_grad=False) if bias else None
        self.ops = ops
        self.profile_name: str | None = None
        self.interleaved = False  # qweight/scales in quantized_for_cpu_kernel's layout
        self.tensor_parallel = None  # as Linear's

    shard_slice = Linear.shard_slice

    def interleave_for_cpu_kernel(self, converted: bool = False) -> None:
        """Store values and scales in the layout quant_kernels.c reads (once, after loading;
        ``converted``: they already are, as saved in the int4 layout cache)."""
        if self.interleaved or self.ops.kernels is None:
            return
        if not converted:
            self.qweight.data, self.scales.data = quantized_for_cpu_kernel(self.kind, self.qweight.data,
                                                                           self.scales.data)
        self.interleaved = True

    def load(self, kind: str, shard: int, tensor: torch.Tensor, name: str, where: str) -> None:
        rows = self.shard_slice(shard)
        if kind == "bias":
            check_shape(name, where, (rows.stop - rows.start,), tuple(tensor.shape))
            self.bias.data[rows].copy_(tensor)
            return
        check_shape(name, where, (rows.stop - rows.start, self.in_features), tuple(tensor.shape))
        if isinstance(tensor, PackedWeight) and (tensor.method, tensor.group) == (self.method, self.group):
            self.qweight[rows].copy_(tensor.values)  # already Anna's format: no float round trip
            self.scales[rows].copy_(tensor.scales)
            return
        tensor = dense(tensor)
        if self.kind == 0:
            q, scale = quantize_int8(tensor, self.group)
        else:
            q, scale = quantize_int4(tensor, self.group)
        self.qweight[rows].copy_(q)
        self.scales[rows].copy_(scale)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 row-major weights (of the given rows): the dense fallback, and embedding lookups.
        With Anna's kernels, all rows land in a buffer reused by the next matmul's conversion."""
        return self.ops.dequantize(self, rows)

    def uses_packed_kernel(self, rows: int) -> bool:
        return self.ops.reads_packed(self, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.quant_linear(self, x)


def make_linear(in_features: int, out_features: int | list[int], *, bias: bool, dtype: torch.dtype,
                ops: ModelOps = TORCH_OPS, method: str = "") -> Linear | QuantLinear:
    """``method``: this layer's own quantization ("": the ops' for every layer)."""
    method = method or ops.quant.method
    if method == "none":
        return Linear(in_features, out_features, bias=bias, dtype=dtype, ops=ops)
    return QuantLinear(in_features, out_features, bias=bias, dtype=dtype, ops=ops, method=method)
