"""The platform seam: one object per device kind, chosen once, owning memory info, the KV
budget's source, synchronize, ops and the decode executor."""

from __future__ import annotations

import pytest
import torch

from anna.model.cache_spec import AttentionSpec, StateSpec, StateTensor
from anna.model.ops import LinearRouting, ModelOps
from anna.platforms import resolve_platform
from anna.platforms.base import Platform
from anna.platforms.cpu import CpuPlatform, read_host_memory
from anna.platforms.xpu import XpuPlatform
from anna.runtime.memory import plan_caches

ATTN = AttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
STATE = StateSpec((StateTensor("conv", (4, 3), torch.float32), StateTensor("recurrent", (2, 8, 8), torch.float32)))


def test_cpu_is_chosen_and_reads_host_memory():
    platform = resolve_platform("cpu")
    assert isinstance(platform, CpuPlatform) and platform.device.type == "cpu"
    info = platform.memory_info()
    assert 0 < info.free <= info.total
    assert platform.activation_dtype(torch.bfloat16) == torch.float32
    assert not platform.asynchronous
    platform.synchronize()  # nothing to wait for, and no error


@pytest.mark.parametrize("name", ["cuda", "xpu"])
def test_a_device_that_is_not_there_is_refused_by_name(name):
    available = torch.cuda.is_available() if name == "cuda" else hasattr(torch, "xpu") and torch.xpu.is_available()
    if available:
        pytest.skip(f"this machine has a {name} device")
    with pytest.raises(ValueError, match=f"device: '{name}'"):
        resolve_platform(name)


class _FakeDeviceMemory:
    """A device backend with 10 GiB of which 2 are in use (for the platform's own arithmetic)."""

    def mem_get_info(self, device):
        return 8 << 30, 10 << 30


class _XpuWithFakeMemory(XpuPlatform):
    def _backend(self):
        return _FakeDeviceMemory()


def test_a_gpu_platform_sizes_kv_from_device_memory_not_host_memory():
    """--device xpu used to get the CPU plan (a share of host RAM); its plan now reads the
    device: 90% of 10 GiB, minus 2 GiB in use and 1 GiB of activation reserve."""
    platform = _XpuWithFakeMemory(torch.device("cpu"))
    plan = plan_caches([ATTN] * 4, platform, block_size=16, max_model_len=128, kv_cache_memory_gib=0,
                       num_blocks_override=0, memory_utilization=0.9, max_num_seqs=4)
    budget = int((10 << 30) * 0.9) - (2 << 30) - (1 << 30)
    assert plan.num_blocks == budget // (16 * ATTN.bytes_per_token * 4)
    assert "of 10.0 GiB" in plan.budget_source and "host" not in " ".join(plan.steps)


def test_cpu_budget_is_a_share_of_available_ram_capped_by_what_can_be_used():
    platform = CpuPlatform(torch.device("cpu"))
    plan = plan_caches([ATTN] * 2, platform, block_size=16, max_model_len=256, kv_cache_memory_gib=0,
                       num_blocks_override=0, memory_utilization=0.9, max_num_seqs=2)
    assert plan.num_tokens == 2 * 256  # max_num_seqs x max_model_len is far below 30% of RAM
    assert read_host_memory().free > 0


def test_cpu_keeps_freed_activation_memory_for_reuse_until_the_release_path_trims_it():
    """keep_freed_memory: a freed 64 MB block (a large prefill's matmul output) stays in malloc's
    heap for the next step instead of going back to the kernel (whose fresh pages would fault
    again); empty_cache, the memory release path's, hands it back."""
    import ctypes

    from anna.platforms.cpu import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("no glibc mallinfo2 here to read the heap with")
    libc.mallinfo2.restype = MallInfo2
    assert keep_freed_memory()
    block = torch.empty(64 << 20, dtype=torch.uint8)
    block.fill_(1)
    in_heap = libc.mallinfo2()
    assert in_heap.hblkhd < 64 << 20  # from the heap, not a mapping of its own
    del block
    freed = libc.mallinfo2()
    assert freed.fordblks - in_heap.fordblks >= 64 << 20 and freed.arena == in_heap.arena  # kept
    resident = _resident_bytes()
    CpuPlatform(torch.device("cpu")).empty_cache()
    assert _resident_bytes() <= resident - (60 << 20)  # handed back (trimmed, or its pages dropped)


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_budget_cap_counts_whole_blocks():
    """A max_model_len that is not a multiple of the block size still fits max_num_seqs sequences:
    each one's last block is partly used (276 tokens take 18 blocks of 16, not 17.25)."""
    plan = plan_caches([ATTN] * 2, CpuPlatform(torch.device("cpu")), block_size=16, max_model_len=276,
                       kv_cache_memory_gib=0, num_blocks_override=0, memory_utilization=0.9, max_num_seqs=3)
    assert plan.num_blocks == 3 * 18


def test_plan_reports_each_kind_and_the_concurrency_that_follows():
    specs = [STATE, STATE, STATE, ATTN]  # a hybrid model: three recurrent layers, one attention layer
    plan = plan_caches(specs, CpuPlatform(torch.device("cpu")), block_size=16, max_model_len=64,
                       kv_cache_memory_gib=0, num_blocks_override=20, memory_utilization=0.9, max_num_seqs=3)
    assert plan.bytes_per_token == ATTN.bytes_per_token
    assert plan.bytes_per_sequence == 3 * (4 * 3 + 2 * 8 * 8) * 4
    assert plan.num_state_slots == 3
    assert plan.max_concurrency(64) == 3  # 20 blocks hold 5 sequences, the state slots 3
    text = plan.describe(64)
    assert f"{ATTN.bytes_per_token} bytes per token" in text and f"{plan.bytes_per_sequence} bytes per sequence" in text
    assert "max concurrency at max_model_len=64: 3.00" in text


def test_state_memory_comes_out_of_the_budget_before_kv_blocks():
    specs = [STATE, ATTN]
    budget_gib = 1 / 1024  # 1 MiB
    plan = plan_caches(specs, CpuPlatform(torch.device("cpu")), block_size=16, max_model_len=64,
                       kv_cache_memory_gib=budget_gib, num_blocks_override=0, memory_utilization=0.9, max_num_seqs=8)
    left = (1 << 20) - 8 * STATE.bytes_per_sequence
    assert plan.num_blocks == left // (16 * ATTN.bytes_per_token)


def test_ops_are_chosen_once_when_the_model_is_built(cache_dir):
    """CPU without Anna's kernels: torch ops with fp32 attention; with them: the kernels' ops."""
    from anna.core.config import ServeSettings
    from anna.model.ops import QuantFormat

    platform = CpuPlatform(torch.device("cpu"))
    cpu = ServeSettings(cpu_kernels=False).resolve(env={}).sections.cpu
    plain = platform.build_ops(cpu, QuantFormat(), None, str(cache_dir))
    assert plain.kernels is None and plain.attention_dtype == torch.float32
    assert type(Platform(torch.device("cpu")).build_ops(cpu, QuantFormat(), None)) is ModelOps
    with_kernels = platform.build_ops(ServeSettings().resolve(env={}).sections.cpu, QuantFormat(), None,
                                      str(cache_dir))
    assert with_kernels.kernels is not None and with_kernels.routing == LinearRouting()


xpu = pytest.mark.skipif(not (hasattr(torch, "xpu") and torch.xpu.is_available()), reason="needs an XPU device")


@pytest.mark.xpu
@xpu
def test_xpu_memory_info_and_synchronize_come_from_torch_xpu():
    platform = resolve_platform("xpu")
    free, total = torch.xpu.mem_get_info(platform.device)
    info = platform.memory_info()
    assert info.total == total and 0 < info.free <= info.total
    platform.synchronize()
