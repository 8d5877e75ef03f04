"""Device choice and the KV cache memory plan."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from anna.model.config import ModelConfig

log = logging.getLogger(__name__)

GIB = 2**30
MIB = 2**20
CPU_KV_FRACTION = 0.3  # of available RAM; pages are only committed when blocks are first written
GPU_ACTIVATION_RESERVE = 1 * GIB  # headroom for activations and the allocator's fragmentation


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            return torch.device("xpu")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    if name == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError("device: 'xpu' was asked for but torch sees no XPU device")
    return torch.device(name)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    return DTYPES.get(str(cfg.torch_dtype).replace("torch.", ""), torch.bfloat16)


def activation_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Activations and the KV cache: fp32 on CPU, where half-precision elementwise and batched
    matmul ops are slower than fp32 and every conversion costs a kernel launch; the weights stay
    in their own dtype (the CPU kernels read bf16/fp16 and accumulate in fp32). Elsewhere the
    weight dtype."""
    return torch.float32 if device.type == "cpu" else weight_dtype


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


@dataclass
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_source: str
    steps: list[str]  # how the budget was reached, one line each, for the start-up log

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self, max_model_len: int) -> str:
        lines = self.steps + [
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.num_tokens * self.bytes_per_token / MIB:.1f} MiB ({self.budget_source})",
            f"max concurrency at max_model_len={max_model_len}: {self.num_tokens / max_model_len:.2f}"]
        return "Memory plan:\n" + "\n".join(f"  {line}" for line in lines)


def module_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of a model's parameters and buffers by device type (shared tensors counted once)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[t.device.type] = out.get(t.device.type, 0) + t.numel() * t.element_size()
    return out


def plan_kv_cache(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, *, block_size: int,
                  max_model_len: int, kv_cache_memory_gib: float, num_blocks_override: int,
                  memory_utilization: float, max_num_seqs: int, weights: dict[str, int] | None = None,
                  activation_peak: int | None = None, profile_tokens: int = 0,
                  workspace_bytes: int = 0) -> KVPlan:
    """Size the KV pool, step by step: weights, the profile run's activation peak, the device's
    memory and the utilization fraction, the compile/graph workspace, what is left for KV."""
    per_token = kv_bytes_per_token(cfg, dtype)
    per_block = per_token * block_size
    steps = ["weights: " + ", ".join(f"{b / MIB:.1f} MiB on {d}" for d, b in sorted((weights or {}).items()))]
    if activation_peak is not None:
        steps.append(f"profile run (prefill of {profile_tokens} tokens, the largest warmup shape): "
                     f"activation peak {activation_peak / MIB:.1f} MiB")
    else:
        steps.append(f"profile run: skipped on {device.type} (its KV budget does not depend on the activation peak)")
    reserve = activation_peak if activation_peak is not None else GPU_ACTIVATION_RESERVE
    steps.append(f"graphs/compile workspace: {workspace_bytes / MIB:.0f} MiB")
    if num_blocks_override:
        blocks, source = num_blocks_override, "num_gpu_blocks_override"
    else:
        if kv_cache_memory_gib > 0:
            budget, source = int(kv_cache_memory_gib * GIB), f"kv_cache_memory={kv_cache_memory_gib} GiB"
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            steps.append(f"device memory: {total / GIB:.2f} GiB total, {used / GIB:.2f} GiB in use, "
                         f"{free / GIB:.2f} GiB left; memory_utilization {memory_utilization:.2f}")
            budget = int(total * memory_utilization) - used - reserve - workspace_bytes
            source = (f"{memory_utilization:.0%} of {total / GIB:.1f} GiB minus {used / GIB:.2f} GiB in use, "
                      f"{reserve / MIB:.0f} MiB activations, {workspace_bytes / MIB:.0f} MiB workspace")
        else:
            avail = available_host_memory()
            steps.append(f"host memory: {avail / GIB:.2f} GiB available; the KV budget is "
                         f"{CPU_KV_FRACTION:.0%} of it (pages are committed only when written)")
            budget = int(avail * CPU_KV_FRACTION)
            source = f"{CPU_KV_FRACTION:.0%} of {avail / GIB:.1f} GiB available RAM"
            enough = max_num_seqs * max_model_len * per_token  # more than this could never be used at once
            if budget > enough:
                budget, source = enough, f"max_num_seqs x max_model_len, below {source}"
        blocks = max(0, budget // per_block)
    plan = KVPlan(int(blocks), block_size, per_token, source, steps)
    if plan.num_tokens < max_model_len:
        raise ValueError(
            f"max_model_len: one sequence of {max_model_len} tokens needs {max_model_len * per_token / MIB:.1f} MiB "
            f"of KV cache but only {plan.num_tokens} tokens fit ({source}); the largest max_model_len that fits is "
            f"{plan.num_tokens}. Lower max_model_len or raise kv_cache_memory.")
    return plan


@torch.inference_mode()
def profile_activation_peak(model: torch.nn.Module, cfg: ModelConfig, num_tokens: int, num_logits: int,
                            block_size: int, device: torch.device, kv_dtype: torch.dtype) -> int | None:
    """Run one prefill of ``num_tokens`` (with a KV pool just big enough for it) and the lm_head on
    ``num_logits`` rows; return the allocator's peak beyond what was in use before. CUDA only: on
    CPU the KV budget is a share of RAM, not what activations leave over, and a 2,048-token prefill
    of a 0.5B model takes ~14 s there (None: not profiled)."""
    from anna.model.attention import build_metadata

    if device.type != "cuda":
        return None
    blocks = -(-num_tokens // block_size)
    caches = _profile_caches(cfg, blocks, block_size, device, kv_dtype)
    positions = torch.arange(num_tokens)
    table = torch.arange(blocks).unsqueeze(0)
    meta = build_metadata(positions.clone(), [0], [num_tokens], table, block_size, cfg.sliding_window, device)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    return _allocator_peak(device, caches, lambda: model.compute_logits(
        model(ids, positions.to(device), caches, meta)[-num_logits:]))


def profile_decode_peak(model: torch.nn.Module, cfg: ModelConfig, rows: int, context: int, block_size: int,
                        device: torch.device, kv_dtype: torch.dtype) -> int | None:
    """The allocator's peak of one decode step of ``rows`` sequences of ``context`` tokens (all
    reading one block table): what the largest captured decode graph keeps in its own memory pool,
    the graph workspace of the KV plan. CUDA only (None elsewhere)."""
    from anna.model.attention import build_metadata

    if device.type != "cuda":
        return None
    blocks = -(-context // block_size)
    caches = _profile_caches(cfg, blocks, block_size, device, kv_dtype)
    last = context - 1
    slots = torch.full((rows,), (last // block_size) * block_size + last % block_size)
    table = torch.arange(blocks).unsqueeze(0).expand(rows, -1)
    meta = build_metadata(slots, [last] * rows, [1] * rows, table, block_size, cfg.sliding_window, device)
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    positions = torch.full((rows,), last, device=device)
    return _allocator_peak(device, caches, lambda: model.compute_logits(model(ids, positions, caches, meta)))


def _profile_caches(cfg: ModelConfig, blocks: int, block_size: int, device: torch.device,
                    kv_dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from anna.model.attention import kv_cache_shape

    shape = kv_cache_shape(blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(cfg.num_hidden_layers)]


def _allocator_peak(device: torch.device, caches: list, run: Callable[[], object]) -> int:
    """Bytes the CUDA allocator's peak rose above what was allocated before ``run``. Then the
    profile's caches go back to the device (the KV plan reads the device's free memory)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    caches.clear()
    torch.cuda.empty_cache()
    return peak
