"""Device choice and the KV cache memory plan."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from anna.model.config import ModelConfig

log = logging.getLogger(__name__)

GIB = 2**30
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

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self, max_model_len: int) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
                f"{self.num_tokens * self.bytes_per_token / 2**20:.1f} MiB ({self.budget_source}); "
                f"max concurrency at max_model_len={max_model_len}: {self.num_tokens / max_model_len:.2f}")


def plan_kv_cache(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, *, block_size: int,
                  max_model_len: int, kv_cache_memory_gib: float, num_blocks_override: int,
                  memory_utilization: float, max_num_seqs: int) -> KVPlan:
    per_token = kv_bytes_per_token(cfg, dtype)
    per_block = per_token * block_size
    if num_blocks_override:
        blocks, source = num_blocks_override, "num_gpu_blocks_override"
    else:
        if kv_cache_memory_gib > 0:
            budget, source = int(kv_cache_memory_gib * GIB), f"kv_cache_memory={kv_cache_memory_gib} GiB"
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            budget = int(total * memory_utilization) - used - GPU_ACTIVATION_RESERVE
            source = f"{memory_utilization:.0%} of {total / GIB:.1f} GiB minus {used / GIB:.2f} GiB in use"
        else:
            avail = available_host_memory()
            budget = int(avail * CPU_KV_FRACTION)
            source = f"{CPU_KV_FRACTION:.0%} of {avail / GIB:.1f} GiB available RAM"
            enough = max_num_seqs * max_model_len * per_token  # more than this could never be used at once
            if budget > enough:
                budget, source = enough, f"max_num_seqs x max_model_len, below {source}"
        blocks = max(0, budget // per_block)
    plan = KVPlan(int(blocks), block_size, per_token, source)
    if plan.num_tokens < max_model_len:
        raise ValueError(
            f"max_model_len: one sequence of {max_model_len} tokens needs {max_model_len * per_token / 2**20:.1f} MiB "
            f"of KV cache but only {plan.num_tokens} tokens fit ({source}); the largest max_model_len that fits is "
            f"{plan.num_tokens}. Lower max_model_len or raise kv_cache_memory.")
    return plan
