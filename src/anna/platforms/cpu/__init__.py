"""The CPU: host memory, fp32 activations, Anna's C kernels (kernels.py, csrc/) picked at start,
weights and KV on huge pages (host_memory.py), and the fused decode stack (fused_decode.py) as
its decode executor."""

from __future__ import annotations

from contextlib import contextmanager

import ctypes
import ctypes.util
import logging
import mmap
import os
from typing import Any, Iterator

import torch

from anna.model.ops import ModelOps, QuantFormat
from anna.platforms.base import GIB, KVBudget, MemoryInfo, Platform, linear_routing, no_graph_reason

log = logging.getLogger(__name__)

KV_FRACTION = 0.3  # of available RAM; pages are only committed when blocks are first written
MADV_DONTNEED = 4


def read_host_memory() -> MemoryInfo:
    """(MemAvailable, MemTotal) from /proc/meminfo, or sysconf where there is none."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    return MemoryInfo(fields.get("MemAvailable", os.sysconf("SC_AVPHYS_PAGES") * page),
                      fields.get("MemTotal", os.sysconf("SC_PHYS_PAGES") * page))


def _describe_kernels(kernels: Any, routing: Any, weight_dtype: torch.dtype) -> str:
    """The start-up log's words for the kernels that serve the matmuls and their bf16 paths."""
    if kernels is None:
        return "torch's"
    words = f"Anna's, built for {kernels.level}"
    if routing.bf16_dot_rows:
        return words + f", bf16 weights on vdpbf16ps from M = {routing.bf16_dot_rows}"
    if kernels.widens_bf16_pairs and weight_dtype == torch.bfloat16 and routing.bf16_pair_max_rows >= 4:
        return words + f", bf16 weights widened in registers at M = 4-{routing.bf16_pair_max_rows}"
    return words


def _describe_prefill_attention(ops: Any) -> str:
    """The start-up log's words for which kernel attends a prompt, and in what dtype."""
    dtype = str(ops.attention_dtype).removeprefix("torch.")
    if ops.kernels is None:
        return f"{dtype}, torch's SDPA"
    sdpa = ops.routing.sdpa_min_tokens
    if not sdpa:
        tiles = ops.attention_dtype == torch.bfloat16 and ops.kernels.level == "amx"
        return f"{dtype}, Anna's kernel" + (" (AMX tiles; SDPA for head sizes not a multiple of 32 up to 256)"
                                            if tiles else "")
    return f"{dtype}, torch's SDPA" + (f" from {sdpa} tokens of context, Anna's kernel below" if sdpa > 1 else "")


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()

# glibc's malloc hands a block over its mmap threshold (128 KB, raised to the size of such a
# block when one is freed, up to 32 MB) straight back to the kernel on free, and trims the heap's
# free top over twice that: the next step's activations of that size then fault in fresh zeroed
# pages, one fault per 4 KB. A prefill allocates each layer's matmul outputs afresh (tens of MB
# at 2,048 tokens), so these thresholds are raised once the model runs here; the memory release
# path (empty_cache) gives the kept memory back.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 256 << 20
MALLOC_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (see above); False where there is no glibc."""
    if _LIBC is None or not hasattr(_LIBC, "mallopt"):
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                and _LIBC.mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


class CpuPlatform(Platform):
    name = "cpu"  # auto_compile_mode stays none: the fused C decode stack is what torch.compile cannot see into
    measures_activation_peak = False  # the KV budget is a share of RAM, not what activations leave over
    ranks_share_memory = True  # tensor-parallel ranks on one host plan their KV in the same RAM
    pages_on_demand = True

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """fp32: half-precision elementwise and batched matmul ops are slower than fp32 on CPUs and
        every conversion costs a kernel launch; weights stay in their own dtype (the kernels read
        bf16/fp16 and accumulate in fp32)."""
        return torch.float32

    def memory_info(self) -> MemoryInfo:
        return read_host_memory()

    @contextmanager
    def numerics(self) -> Iterator[None]:
        """Denormal floats flush to zero while the model runs: x86 computes on them 10-100x slower,
        and decays (Gated DeltaNet's exp of a running sum) make them in bulk; below 1.2e-38 they
        change no logit. Process-wide state, so it is set for the forward pass only."""
        torch.set_flush_denormal(True)
        try:
            yield
        finally:
            torch.set_flush_denormal(False)

    def synchronize(self) -> None:
        pass

    @property
    def asynchronous(self) -> bool:
        return False

    def allocator_idle_bytes(self) -> int:
        return 0

    def empty_cache(self) -> None:
        """Give the heap's free memory back to the kernel (kept there by keep_freed_memory)."""
        if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
            _LIBC.malloc_trim(0)

    def kv_budget(self, *, memory_utilization: float, reserve: int, workspace: int, enough: int) -> KVBudget:
        avail = self.memory_info().free
        steps = [f"host memory: {avail / GIB:.2f} GiB available; the KV budget is {KV_FRACTION:.0%} of it "
                 "(pages are committed only when written)"]
        budget, source = int(avail * KV_FRACTION), f"{KV_FRACTION:.0%} of {avail / GIB:.1f} GiB available RAM"
        if budget > enough:  # more than this could never be used at once
            budget, source = enough, f"max_num_seqs x max_model_len, below {source}"
        return KVBudget(budget, source, steps)

    def release_pages(self, tensor: torch.Tensor, first: int, count: int) -> int:
        """madvise(MADV_DONTNEED) the whole pages inside rows [first, first+count)."""
        if _LIBC is None:
            return 0
        row = tensor[0].numel() * tensor.element_size()
        start, end = tensor.data_ptr() + first * row, tensor.data_ptr() + (first + count) * row
        page = mmap.PAGESIZE
        start, end = -(-start // page) * page, end // page * page
        if end <= start:
            return 0
        if _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) != 0:
            return 0
        return end - start

    def commit_pages(self, tensor: torch.Tensor, first: int, count: int) -> int:
        """Write zeros over the rows: each page's first write (its page fault) happens here."""
        rows = tensor[first:first + count]
        rows.zero_()
        return rows.numel() * rows.element_size()

    def new_cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
        """Untouched pages cost no RAM until a block is first written (torch.empty or mmap)."""
        if huge_pages:
            from anna.platforms.cpu.host_memory import huge_page_zeros
            return huge_page_zeros(shape, dtype)
        return torch.empty(shape, dtype=dtype)

    def place_weights(self, model: torch.nn.Module, huge_pages: bool) -> None:
        if huge_pages:
            from anna.platforms.cpu.host_memory import move_to_huge_pages
            moved = move_to_huge_pages(model)
            if moved:
                log.info("Weights on huge pages: %.1f MiB", moved / 2**20)

    def build_ops(self, cpu: Any, quant: QuantFormat, profiler: Any, cache_dir: str = "~/.cache/anna",
                  weight_dtype: torch.dtype | None = None) -> ModelOps:
        """``weight_dtype``: the model's. A bf16 model (quantized or not) on a CPU with hardware
        bf16 runs its large matmuls and its prefill attention in bf16 (several times fp32's rate
        for the matmuls, about twice for attention at 2,048 tokens): at the amx level on Anna's
        tile kernels where they take the shape, else on oneDNN's."""
        from anna.platforms.cpu.isa import detect_isa
        from anna.platforms.cpu.kernels import build_cpu_kernels
        from anna.platforms.cpu.ops import CpuKernelOps, CpuTorchOps

        isa = detect_isa(force=cpu.cpu_isa)
        log.info(isa.describe())
        if not keep_freed_memory():
            log.debug("glibc's malloc thresholds left as they are (no mallopt here)")
        kernels = build_cpu_kernels(cache_dir, cpu.cpu_kernel_compiler, isa) if cpu.cpu_kernels else None
        tiles = kernels is not None and kernels.level == "amx"
        routing = linear_routing(cpu, bf16_matmul=isa.bf16_matmul and weight_dtype == torch.bfloat16,
                                 sdpa_outruns_kernel=isa.has("amx") and not tiles, amx=isa.has("amx"))
        ops = CpuTorchOps(quant, routing, profiler) if kernels is None else CpuKernelOps(kernels, quant, routing, profiler)
        if routing.bf16_matmul:
            ops.attention_dtype = torch.bfloat16
        panels = kernels is not None and kernels.level == "avx2" and not routing.bf16_matmul
        log.info("CPU kernels: %s; larger bf16 matmuls: %s; prefill attention: %s",
                 _describe_kernels(kernels, routing, weight_dtype),
                 ("fp32 on Anna's register-blocked GEMM, reading the weights as stored" if panels else
                  "fp32" if not routing.bf16_matmul else
                  "bf16 on Anna's AMX tile kernel (oneDNN's for shapes it does not take, and quantized weights)"
                  if tiles else "bf16 (oneDNN, hardware bf16)"),
                 _describe_prefill_attention(ops))
        return ops

    def calibrate(self, model: torch.nn.Module, ops: ModelOps, cpu: Any, *, cache_dir: str, max_chunk: int,
                  max_rows: int, refresh: bool = False) -> Any:
        from anna.platforms.cpu.calibration import calibrate
        from anna.platforms.cpu.isa import detect_isa

        with self.numerics():
            return calibrate(model, ops, detect_isa(force=cpu.cpu_isa), cache_dir=cache_dir, max_chunk=max_chunk,
                             max_rows=max_rows, refresh=refresh)

    def capability(self) -> str:
        return f"cpu-{torch.backends.cpu.get_cpu_capability()}"

    def kernel_layout(self, ops: ModelOps) -> str:
        # (named anew when the kernels' layout changes, so that a cache of the old one is not read)
        return "cpu-kernels-int8-lanes" if ops.kernels is not None else "row-major"

    def decode_executor(self, choice: str, model: torch.nn.Module, ops: ModelOps, *, profiling: bool,
                        max_num_seqs: int, max_model_len: int, block_size: int) -> Any:
        """graph here is Anna's fused C decode stack (one call for all layers), measured faster than
        layer by layer (docs/BENCHMARKS.md), so auto picks it where it can run."""
        if choice == "eager":
            return None
        from anna.platforms.cpu.fused_decode import fused_decode_executor

        why = no_graph_reason(profiling, model)
        if why is None and ops.kernels is None:
            why = "needs Anna's CPU kernels"
        executor = fused_decode_executor(model, ops) if why is None else None
        if why is None and executor is None:
            why = f"the fused decode stack does not serve {type(model).__name__}"
        if why is not None:
            if choice == "graph":
                log.warning("decode_executor=graph: %s; running eager", why)
            return None
        return executor
