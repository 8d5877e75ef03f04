"""What differs between device kinds, in one object chosen at start (platforms/__init__.py).

Everything device-specific that is not a model op lives behind this interface: memory info and
the KV budget's source of truth, synchronize, the allocator's cache, where cache tensors and
weights live, the ops the model's layers are built with, and the decode executor (what
``--decode-executor graph`` means on this device). Adding a device is one platform file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch

from anna.model.ops import LinearRouting, ModelOps, QuantFormat

log = logging.getLogger(__name__)

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class MemoryInfo:
    free: int
    total: int


@dataclass
class KVBudget:
    bytes: int
    source: str  # one phrase for the plan's summary line
    steps: list[str]  # how it was reached, for the start-up log


class Platform:
    """The base: a device whose memory is its own (CUDA, XPU). The CPU platform overrides what
    differs there (host memory, Anna's kernels, huge pages)."""

    name = "base"
    auto_compile_mode = "none"  # what --compile-mode auto means here: no GPU measurement has said otherwise yet
    measures_activation_peak = True  # the KV plan subtracts a profile run's peak from device memory
    ranks_share_memory = False  # tensor-parallel ranks on one host each have a device of their own
    pages_on_demand = False  # cache memory is committed as it is written and can be handed back by range
    activation_reserve = 1 * GIB  # headroom when no profile run measured the peak

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # ---- dtypes and memory ----
    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """Activations and the KV cache: the weights' dtype."""
        return weight_dtype

    def memory_info(self) -> MemoryInfo:
        free, total = self._backend().mem_get_info(self.device)
        return MemoryInfo(free, total)

    def numerics(self) -> ContextManager:
        """The floating-point mode a forward pass runs in (CPU: denormals flushed), restored after."""
        return nullcontext()

    def synchronize(self) -> None:
        self._backend().synchronize(self.device)

    @property
    def asynchronous(self) -> bool:
        """Whether kernels run after the host returns (the profiler then synchronizes regions)."""
        return True

    def allocator_idle_bytes(self) -> int:
        """Memory the caching allocator holds but no tensor uses."""
        b = self._backend()
        return b.memory_reserved(self.device) - b.memory_allocated(self.device)

    def empty_cache(self) -> None:
        self._backend().empty_cache()

    def allocator_peak(self, run: Callable[[], object]) -> int:
        """Bytes the allocator's peak rose above what was allocated before ``run``."""
        b = self._backend()
        b.synchronize(self.device)
        b.reset_peak_memory_stats(self.device)
        before = b.memory_allocated(self.device)
        run()
        b.synchronize(self.device)
        return b.max_memory_allocated(self.device) - before

    def kv_budget(self, *, memory_utilization: float, reserve: int, workspace: int, enough: int) -> KVBudget:
        """What the KV cache may take when no budget is given: the utilization share of device
        memory, minus what is in use, the activation reserve and the graph workspace."""
        info = self.memory_info()
        used = info.total - info.free
        steps = [f"device memory: {info.total / GIB:.2f} GiB total, {used / GIB:.2f} GiB in use, "
                 f"{info.free / GIB:.2f} GiB left; memory_utilization {memory_utilization:.2f}"]
        budget = int(info.total * memory_utilization) - used - reserve - workspace
        source = (f"{memory_utilization:.0%} of {info.total / GIB:.1f} GiB minus {used / GIB:.2f} GiB in use, "
                  f"{reserve / MIB:.0f} MiB activations, {workspace / MIB:.0f} MiB workspace")
        return KVBudget(budget, source, steps)

    def release_pages(self, tensor: torch.Tensor, first: int, count: int) -> int:
        """Give the memory of rows [first, first+count) of a cache tensor back; bytes returned.
        Device memory stays with the allocator (``empty_cache`` returns what it holds idle)."""
        return 0

    def commit_pages(self, tensor: torch.Tensor, first: int, count: int) -> int:
        """Commit the memory of rows [first, first+count) of a cache tensor, rows that hold nothing
        (where pages_on_demand); bytes written. Device memory is committed when it is allocated."""
        return 0

    # ---- tensors and weights ----
    def new_cache_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def place_weights(self, model: torch.nn.Module, huge_pages: bool) -> None:
        """After loading: move the weights where this device serves them best (nothing here)."""

    def capability(self) -> str:
        """What the device can run, as far as a cached weight layout depends on it."""
        return self.name

    # ---- execution ----
    def build_ops(self, cpu: Any, quant: QuantFormat, profiler: Any, cache_dir: str = "~/.cache/anna",
                  weight_dtype: torch.dtype | None = None) -> ModelOps:
        """The ops the model's layers are built with (``cpu``: the cpu settings section;
        ``cache_dir``: where compiled kernels are kept; ``weight_dtype``: the model's)."""
        return ModelOps(quant, linear_routing(cpu), profiler)

    def calibrate(self, model: torch.nn.Module, ops: ModelOps, cpu: Any, *, cache_dir: str, max_chunk: int,
                  max_rows: int, refresh: bool = False) -> Any:
        """This host's measured routing thresholds and chunk size for the model (a Calibration,
        platforms/cpu/calibration.py), or None where the device's built-in values stand."""
        return None

    def kernel_layout(self, ops: ModelOps) -> str:
        """The weight layout the ops read, part of the int4 cache key."""
        return "row-major"

    def decode_executor(self, choice: str, model: torch.nn.Module, ops: ModelOps, *, profiling: bool,
                        max_num_seqs: int, max_model_len: int, block_size: int) -> Any:
        """The executor of decode-only steps that ``choice`` (auto | eager | graph) resolves to
        here, or None for eager (layer by layer). Warns once when graph was asked for and cannot run."""
        if choice == "graph":
            log.warning("decode_executor=graph: graph capture is not implemented for %s; running eager", self.name)
        return None

    def _backend(self) -> Any:
        return getattr(torch, self.name)


# int4_gemv_m_threshold and int8_gemv_m_threshold -1: the packed kernel up to this M, by whether the
# dequantized GEMM runs on AMX tiles (oneDNN's bf16 tiles, a bf16 model on an AMX CPU). Without them
# the packed kernel is the faster up to 2048: with the GEMM in fp32 (benchmarks/matmul_routing.py
# --quantization int4), and on a Zen 4 with it in bf16 on AVX512-BF16 (`anna tune --quantization
# int4` / `int8`: 2,669 against 4,068 ms a pass of the 0.5B layers at 2048, and 2,492 against
# 3,945); on AMX it is up to M = 112 and the bf16 GEMM from 128 on. The int8 kernel runs int4's
# tiles, and calibration measures each kind on its own host.
PACKED_MAX_ROWS = {False: 2048, True: 128}


# cpu_bf16_dot_min_rows -1: the weight-streaming kernel's bf16 dot products from this M on, where the
# CPU has them (benchmarks/matmul_routing.py --strategies anna_gemv anna_gemv_bf16_dot, Zen 4: 1.1-1.35x
# the fp32 kernel at M = 4, about 2x from M = 8, no gain below 4)
BF16_DOT_MIN_ROWS = 8

# cpu_bf16_pair_max_rows -1: the AVX2 kernel's bf16 weights widened in registers up to this M
# (benchmarks/kernel_ab.py against the conversion pass: an AVX2-only Zen 4 gained 1.0-1.2x up to
# M = 64, a Zen 1 1.1-1.5x at 4-16 and lost 1-15% from 32 on; calibration measures each host)
BF16_PAIR_MAX_ROWS = 32


# cpu_sdpa_min_tokens -1: torch's SDPA for prompt attention from this many tokens where SDPA outruns
# Anna's kernel: a bf16 model's attention on an AMX CPU whose kernels were not built with the tiles
# (benchmarks/attention_bench.py --prefill, a 2-vCPU AMX Xeon: SDPA in bf16 (oneDNN's tiles) level
# with the vdpbf16ps kernel at 16 tokens, 1.9x at 256, 3.2x at 2,048), else never: Anna's kernel on
# AMX tiles ran 1.4-2x SDPA in bf16 at 64-2,048 tokens there, and on a Zen 4 (AVX512-BF16, no AMX)
# the vdpbf16ps kernel ran 2.3x SDPA's bf16 at 2,048
SDPA_MIN_TOKENS = {False: 0, True: 1}


def linear_routing(cpu: Any, bf16_matmul: bool = False, sdpa_outruns_kernel: bool = False,
                   amx: bool = False) -> LinearRouting:
    """The matmul routing thresholds of the cpu settings section (``bf16_matmul``: what the CPU's
    instruction sets allow for this model, platforms/cpu/isa.py; without it no bf16 dot product runs,
    whatever cpu_bf16_dot_min_rows says; ``sdpa_outruns_kernel``: an AMX CPU whose kernels have no
    tiles, see SDPA_MIN_TOKENS; ``amx``: the CPU has AMX tiles, see PACKED_MAX_ROWS)."""
    packed = PACKED_MAX_ROWS[bf16_matmul and amx]
    threshold = cpu.int4_gemv_m_threshold if cpu.int4_gemv_m_threshold >= 0 else packed
    int8_threshold = cpu.int8_gemv_m_threshold if cpu.int8_gemv_m_threshold >= 0 else packed
    dot_rows = cpu.cpu_bf16_dot_min_rows if cpu.cpu_bf16_dot_min_rows >= 0 else BF16_DOT_MIN_ROWS
    pair_rows = cpu.cpu_bf16_pair_max_rows if cpu.cpu_bf16_pair_max_rows >= 0 else BF16_PAIR_MAX_ROWS
    sdpa = cpu.cpu_sdpa_min_tokens if cpu.cpu_sdpa_min_tokens >= 0 else SDPA_MIN_TOKENS[bf16_matmul and sdpa_outruns_kernel]
    return LinearRouting(cpu.cpu_gemv_max_rows, cpu.cpu_upcast_min_rows, cpu.int4_matmul, threshold, bf16_matmul,
                         dot_rows if bf16_matmul else 0, pair_rows, cpu.cpu_mlp_tile_rows, sdpa, int8_threshold)


def no_graph_reason(profiling: bool, model: Any) -> str | None:
    """Why no decode graph may run whatever the device, or None."""
    if profiling:
        return "--profile-runtime times each op"
    if getattr(model.config, "moe", None) is not None:
        return "mixture-of-experts layers choose their experts on the host each step"
    return None
