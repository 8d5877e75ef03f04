"""How a paged attention layer stores its K and V rows (``--kv-cache-dtype``).

Float formats keep a row as ``head_dim`` values of their dtype. Quantized formats keep it as bytes:
the row's data, then its scale as one fp16 value, so a block holds its own scales and every copy
of rows (prefix blocks, the exact prompt cache, memory release) moves them along without knowing
the format:

- ``int8``: symmetric, ``round(x / s)`` with ``s = max|x| / 127`` per row (head_dim + 2 bytes).
- ``fp8_e4m3``: ``x / s`` in float8 e4m3 with ``s = max|x| / 448`` per row (head_dim + 2 bytes).
- ``turboquant4`` / ``turboquant3`` (TurboQuant, Zandieh et al. 2025, its MSE variant): each
  coordinate of the unit row after a fixed random rotation as the index of the nearest of 16 / 8
  levels (head_dim / 2 or 3 * head_dim / 8 bytes + 2), and a scale. After a random rotation every
  coordinate of a unit vector follows the same law whatever the vector, the marginal of a uniform
  point on the sphere, density proportional to (1 - x^2)^((d - 3) / 2); the levels are the
  Lloyd-Max quantizer of that law (``lloyd_max_levels``), so the error is data-oblivious: about
  0.0095 (4 bits) and 0.034 (3 bits) squared error per unit vector. The scale is the row's norm
  divided by the norm of its levels, so a decoded row is exactly as long as the row was: the
  levels alone shrink a row by a few percent, by a different amount for each row, which scales
  each key's attention score by its own error and cost the demo model retrievals that fp32 rows
  make (docs/BENCHMARKS.md, "Answer quality"). The rotation is one seeded
  random orthogonal matrix per head size, the same for every head and layer; attention rotates
  the query by it instead of rotating every key back, and rotates its output back once.

This module is the reference (torch, any device); the CPU kernels (csrc/kv_cache.c) read and
write the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TURBOQUANT_BITS = {"turboquant4": 4, "turboquant3": 3}
QUANTIZED_FORMATS = ("fp8_e4m3", "int8", *TURBOQUANT_BITS)
KV_CACHE_DTYPES = ("auto", *FLOAT_FORMATS, *QUANTIZED_FORMATS)
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's name
ROTATION_SEED = 20250428  # fixed: a cache's rows are read with the rotation they were written with
FP8_MAX = 448.0  # the largest float8 e4m3 value
INT8_MAX = 127.0
SCALE_BYTES = 2  # the fp16 scale at the end of a quantized row


def canonical_kv_cache_dtype(name: str) -> str:
    return KV_CACHE_DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True)
class KVFormat:
    """The stored form of one K or V row of ``head_dim`` values."""

    name: str  # a float dtype's name, or fp8_e4m3 | int8 | turboquant4 | turboquant3
    head_dim: int

    def __post_init__(self) -> None:
        if self.name not in FLOAT_FORMATS and self.name not in QUANTIZED_FORMATS:
            raise ValueError(f"kv_cache_dtype: unknown KV cache format {self.name!r}")
        if self.quantized and self.head_dim % 8:
            raise ValueError(f"kv_cache_dtype: {self.name} needs a head size that is a multiple of 8; this model's "
                             f"is {self.head_dim}")

    @property
    def quantized(self) -> bool:
        return self.name not in FLOAT_FORMATS

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensors' dtype: a float format's own, bytes for a quantized one."""
        return FLOAT_FORMATS.get(self.name, torch.uint8)

    @property
    def row_width(self) -> int:
        """The cache tensors' last dimension."""
        return self.head_dim if not self.quantized else self.data_bytes + SCALE_BYTES

    @property
    def data_bytes(self) -> int:
        """Bytes of a quantized row before its scale."""
        bits = TURBOQUANT_BITS.get(self.name, 8)
        return self.head_dim * bits // 8

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.storage_dtype.itemsize

    def stores_exactly(self, dtype: torch.dtype) -> bool:
        """Whether rows of ``dtype`` come back from the cache unchanged."""
        return self.storage_dtype == dtype

    # ---- the reference encoding ----
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [..., head_dim] (any float dtype) -> their stored form [..., row_width]."""
        if not self.quantized:
            return x.to(self.storage_dtype)
        x = x.float()
        if self.name in TURBOQUANT_BITS:
            norm = x.norm(dim=-1, keepdim=True)
            unit = x / norm.clamp_min(torch.finfo(torch.float32).tiny)
            rotated = unit @ rotation(self.head_dim, x.device).T
            levels, bounds = turboquant_levels(self.head_dim, TURBOQUANT_BITS[self.name], x.device)
            idx = torch.bucketize(rotated, bounds)
            scale = (norm / levels[idx].norm(dim=-1, keepdim=True)).half()  # the decoded row keeps x's length
            data = _pack_indices(idx, TURBOQUANT_BITS[self.name])
        else:
            top = FP8_MAX if self.name == "fp8_e4m3" else INT8_MAX
            scale = (x.abs().amax(dim=-1, keepdim=True) / top).half()
            s = scale.float()
            v = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0)
            if self.name == "int8":
                data = v.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8).view(torch.uint8)
            else:
                data = v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([data, scale.view(torch.uint8)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored rows [..., row_width] -> values [..., head_dim] in ``dtype``."""
        if not self.quantized:
            return rows.to(dtype)
        rows = rows.contiguous()
        data, scale = rows[..., :self.data_bytes], rows[..., self.data_bytes:].contiguous().view(torch.float16).float()
        if self.name in TURBOQUANT_BITS:
            bits = TURBOQUANT_BITS[self.name]
            levels = turboquant_levels(self.head_dim, bits, rows.device)[0]
            rotated = levels[_unpack_indices(data, bits, self.head_dim)]
            return ((rotated @ rotation(self.head_dim, rows.device)) * scale).to(dtype)
        if self.name == "int8":
            values = data.view(torch.int8).float()
        else:
            values = data.view(torch.float8_e4m3fn).float()
        return (values * scale).to(dtype)


def kv_format(kv_cache_dtype: str, activation_dtype: torch.dtype, head_dim: int) -> KVFormat:
    """The format a ``--kv-cache-dtype`` value stores rows in; ``auto``: the activation dtype
    (fp32 on CPU, the model's dtype on GPU)."""
    name = canonical_kv_cache_dtype(kv_cache_dtype)
    if name == "auto":
        name = next(n for n, d in FLOAT_FORMATS.items() if d == activation_dtype)
    return KVFormat(name, head_dim)


def _pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Level indices [..., D] -> bytes: 4 bits, two per byte (even index in the low nibble); 3 bits,
    eight per three bytes (index j of a group in bits 3j .. 3j + 2 of its little-endian 24 bits)."""
    idx = idx.to(torch.int32)
    if bits == 4:
        return (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    groups = idx.reshape(*idx.shape[:-1], -1, 8)
    word = (groups << (3 * torch.arange(8, dtype=torch.int32, device=idx.device))).sum(-1)
    out = torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], dim=-1)
    return out.reshape(*idx.shape[:-1], -1).to(torch.uint8)


def _unpack_indices(data: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    data = data.to(torch.int64)
    if bits == 4:
        return torch.stack([data & 15, data >> 4], dim=-1).reshape(*data.shape[:-1], head_dim)
    b = data.reshape(*data.shape[:-1], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    idx = (word.unsqueeze(-1) >> (3 * torch.arange(8, device=data.device))) & 7
    return idx.reshape(*data.shape[:-1], head_dim)


@lru_cache(maxsize=None)
def _rotation_cpu(head_dim: int) -> torch.Tensor:
    """A random orthogonal matrix drawn uniformly (Haar) from a fixed seed: the QR factor of a
    Gaussian matrix, its columns' signs fixed by R's diagonal."""
    g = torch.Generator().manual_seed(ROTATION_SEED + head_dim)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float().contiguous()


@lru_cache(maxsize=None)
def _on_device(what: str, head_dim: int, bits: int, device: torch.device) -> torch.Tensor:
    if what == "rotation":
        return _rotation_cpu(head_dim).to(device)
    levels, bounds = lloyd_max_levels(head_dim, bits)
    return (levels if what == "levels" else bounds).to(device)


def rotation(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The [head_dim, head_dim] rotation R: a unit row u is stored as the levels nearest R u."""
    return _on_device("rotation", head_dim, 0, torch.device(device))


def turboquant_levels(head_dim: int, bits: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(levels [2^bits], boundaries [2^bits - 1]) for rotated unit rows of ``head_dim``, fp32."""
    device = torch.device(device)
    return _on_device("levels", head_dim, bits, device), _on_device("bounds", head_dim, bits, device)


@lru_cache(maxsize=None)
def lloyd_max_levels(head_dim: int, bits: int, grid: int = 1 << 20, iterations: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """The Lloyd-Max quantizer of one coordinate of a uniform unit vector in R^head_dim: levels
    that are the means of their cells, cells split halfway between levels. Computed once per head
    size on a fine grid in float64 (about 0.1 s), from Gaussian quantiles scaled by 1/sqrt(d)."""
    d, n = head_dim, 1 << bits
    x, density = _coordinate_law(d, grid)
    mass = torch.cumsum(density, 0)
    moment = torch.cumsum(density * x, 0)
    total = mass[-1]
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    levels = torch.special.ndtri(p) / d ** 0.5
    for _ in range(iterations):
        bounds = (levels[1:] + levels[:-1]) / 2
        cut = torch.searchsorted(x, bounds)
        m0 = torch.cat([mass.new_zeros(1), mass[cut - 1], total.view(1)])
        m1 = torch.cat([moment.new_zeros(1), moment[cut - 1], moment[-1].view(1)])
        new = (m1[1:] - m1[:-1]) / (m0[1:] - m0[:-1]).clamp_min(1e-300)
        if torch.allclose(new, levels, rtol=0, atol=1e-12):
            levels = new
            break
        levels = new
    bounds = (levels[1:] + levels[:-1]) / 2
    return levels.float(), bounds.float()


def turboquant_mse(head_dim: int, bits: int) -> float:
    """The expected squared error of a unit vector (1 - d * sum of level^2 * cell mass): what the
    round-trip test checks the stored rows against."""
    levels, bounds = lloyd_max_levels(head_dim, bits)
    x, density = _coordinate_law(head_dim, 1 << 20)
    cell = torch.bucketize(x.float(), bounds)
    return float(((x - levels.double()[cell]) ** 2 * density).sum() / density.sum() * head_dim)


def _coordinate_law(d: int, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid points on [-1, 1] and the (unnormalized) density there of one coordinate of a uniform
    unit vector in R^d: (1 - x^2)^((d - 3) / 2)."""
    x = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid * 2 - 1
    return x, (1 - x * x).clamp_min(0) ** ((d - 3) / 2)
