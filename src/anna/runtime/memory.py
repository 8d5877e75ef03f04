"""The cache memory plan: from the model's cache specs and the platform's memory, how many KV
blocks and per-sequence state slots the engine keeps; and the profile runs it is based on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from anna.model.cache_spec import AttentionSpec, CacheSpec, kv_bytes_per_token, state_bytes_per_sequence
from anna.model.config import ModelConfig
from anna.platforms import Platform

GIB = 2**30
MIB = 2**20
SNAPSHOT_BUDGET_SHARE = 0.25  # the most of the cache budget that automatic state snapshots take

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    return DTYPES.get(str(cfg.torch_dtype).replace("torch.", ""), torch.bfloat16)


@dataclass
class CachePlan:
    num_blocks: int  # paged KV blocks (for the layers with an AttentionSpec)
    block_size: int
    bytes_per_token: int  # paged KV, all layers
    num_state_slots: int  # per-sequence state slots (for the layers with a StateSpec), one per running sequence
    bytes_per_sequence: int  # per-sequence state, all layers
    budget_source: str
    steps: list[str]  # how the budget was reached, one line each, for the start-up log
    num_state_snapshots: int = 0  # states kept at block boundaries of cached prefixes (state_cache.py)
    num_state_checkpoints: int = 0  # speculative decoding: states kept after each verified token, to roll back to
    kv_formats: str = ""  # how the paged KV rows are stored (--kv-cache-dtype resolved), for the log

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, max_model_len: int) -> float:
        """Sequences of max_model_len tokens the caches hold at once."""
        by_kv = self.num_tokens / max_model_len if self.bytes_per_token else float("inf")
        by_state = self.num_state_slots if self.bytes_per_sequence else float("inf")
        return min(by_kv, by_state)

    def describe(self, max_model_len: int) -> str:
        lines = list(self.steps)
        if self.bytes_per_token:
            lines.append(f"paged attention KV: {self.kv_formats} rows, {self.bytes_per_token} bytes per token; "
                         f"{self.num_blocks} blocks x "
                         f"{self.block_size} tokens = {self.num_tokens} tokens, "
                         f"{self.num_tokens * self.bytes_per_token / MIB:.1f} MiB ({self.budget_source})")
        if self.bytes_per_sequence:
            lines.append(f"per-sequence state: {self.bytes_per_sequence} bytes per sequence; {self.num_state_slots} "
                         f"slots, {self.num_state_slots * self.bytes_per_sequence / MIB:.1f} MiB")
            lines.append(f"state snapshots for prefix reuse: {self.num_state_snapshots}, "
                         f"{self.num_state_snapshots * self.bytes_per_sequence / MIB:.1f} MiB")
            if self.num_state_checkpoints:
                lines.append(f"speculative decoding state checkpoints: {self.num_state_checkpoints}, "
                             f"{self.num_state_checkpoints * self.bytes_per_sequence / MIB:.1f} MiB")
        lines.append(f"max concurrency at max_model_len={max_model_len}: {self.max_concurrency(max_model_len):.2f}")
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


def plan_caches(specs: list[CacheSpec], platform: Platform, *, block_size: int, max_model_len: int,
                kv_cache_memory_gib: float, num_blocks_override: int, memory_utilization: float, max_num_seqs: int,
                weights: dict[str, int] | None = None, activation_peak: int | None = None, profile_tokens: int = 0,
                workspace_bytes: int = 0, state_snapshots: int = 0, snapshots_auto: bool = False,
                state_checkpoints: int = 0, ranks_sharing_memory: int = 1) -> CachePlan:
    """Size the caches, step by step: weights, the profile run's activation peak, the platform's
    memory and the utilization fraction, the compile/graph workspace; the per-sequence state of
    max_num_seqs sequences and ``state_snapshots`` snapshots first, the rest for paged KV.
    ``snapshots_auto``: the snapshot count is a default, capped at SNAPSHOT_BUDGET_SHARE of the
    budget (a large model's states are tens of MiB each). ``state_checkpoints``: speculative
    decoding's states of verified tokens (state_cache.py), reserved like the slots.
    ``ranks_sharing_memory``: tensor-parallel ranks whose caches come out of the same memory (CPU
    ranks on one host): each plans its own caches in an equal share of the automatic budget."""
    per_token = kv_bytes_per_token(specs)
    per_seq = state_bytes_per_sequence(specs)
    slots = max_num_seqs if per_seq else 0
    snapshots = state_snapshots if per_seq else 0
    checkpoints = state_checkpoints if per_seq else 0
    state_bytes = (slots + snapshots + checkpoints) * per_seq
    per_block = per_token * block_size
    steps = ["weights: " + ", ".join(f"{b / MIB:.1f} MiB on {d}" for d, b in sorted((weights or {}).items()))]
    if activation_peak is not None:
        steps.append(f"profile run (prefill of {profile_tokens} tokens, the largest warmup shape): "
                     f"activation peak {activation_peak / MIB:.1f} MiB")
    else:
        steps.append(f"profile run: skipped on {platform.name} (its KV budget does not depend on the activation peak)")
    reserve = activation_peak if activation_peak is not None else platform.activation_reserve
    steps.append(f"graphs/compile workspace: {workspace_bytes / MIB:.0f} MiB")
    def state_step() -> None:
        if state_bytes:
            steps.append(f"per-sequence state: {slots} slots (max_num_seqs) + {snapshots} prefix snapshots + "
                         f"{checkpoints} speculative checkpoints x {per_seq} bytes = {state_bytes / MIB:.1f} MiB")

    if num_blocks_override:
        state_step()
        blocks, source = num_blocks_override, "num_gpu_blocks_override"
    else:
        if kv_cache_memory_gib > 0:
            budget, source = int(kv_cache_memory_gib * GIB), f"kv_cache_memory={kv_cache_memory_gib} GiB"
        else:
            found = platform.kv_budget(memory_utilization=memory_utilization, reserve=reserve,
                                       workspace=workspace_bytes,  # in whole blocks: a sequence's last is partly used
                                       enough=max_num_seqs * -(-max_model_len // block_size) * per_block + state_bytes)
            budget, source = found.bytes, found.source
            steps += found.steps
            if ranks_sharing_memory > 1:
                budget //= ranks_sharing_memory
                source += f", shared by {ranks_sharing_memory} ranks"
                steps.append(f"each of the {ranks_sharing_memory} ranks on this host: {budget / GIB:.2f} GiB")
        if snapshots_auto and per_seq and snapshots * per_seq > SNAPSHOT_BUDGET_SHARE * budget:
            snapshots = int(SNAPSHOT_BUDGET_SHARE * budget // per_seq)
            state_bytes = (slots + snapshots + checkpoints) * per_seq
            steps.append(f"prefix snapshots (auto): capped at {SNAPSHOT_BUDGET_SHARE:.0%} of the budget")
        state_step()
        blocks = max(0, (budget - state_bytes) // per_block) if per_block else 0
    formats = ", ".join(sorted({s.format.name for s in specs if isinstance(s, AttentionSpec)}))
    plan = CachePlan(int(blocks), block_size, per_token, slots, per_seq, source, steps, snapshots, checkpoints, formats)
    if per_token and plan.num_tokens < max_model_len:
        raise ValueError(
            f"max_model_len: one sequence of {max_model_len} tokens needs {max_model_len * per_token / MIB:.1f} MiB "
            f"of KV cache but only {plan.num_tokens} tokens fit ({source}); the largest max_model_len that fits is "
            f"{plan.num_tokens}. Lower max_model_len or raise kv_cache_memory.")
    return plan


@torch.inference_mode()
def profile_activation_peak(model: torch.nn.Module, specs: list[CacheSpec], platform: Platform, num_tokens: int,
                            num_logits: int, block_size: int) -> int | None:
    """Run one prefill of ``num_tokens`` (with caches just big enough for it) and the lm_head on
    ``num_logits`` rows; return the allocator's peak beyond what was in use before. Only where the
    platform's KV budget depends on it (not on CPU, where a 2,048-token prefill of a 0.5B model
    takes ~14 s: None, not profiled)."""
    from anna.model.attention import build_metadata

    if not platform.measures_activation_peak:
        return None
    cfg = model.config
    blocks = -(-num_tokens // block_size)
    caches = _profile_caches(specs, platform, blocks, block_size)
    positions = torch.arange(num_tokens)
    table = torch.arange(blocks).unsqueeze(0)
    meta = build_metadata(positions.clone(), [0], [num_tokens], table, block_size, cfg.sliding_window, platform.device)
    meta.state_slots = torch.zeros(1, dtype=torch.long, device=platform.device)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    ids = ids.to(platform.device)
    return _peak(platform, caches, lambda: model.compute_logits(
        model(ids, positions.to(platform.device), caches, meta)[-num_logits:]))


def profile_decode_peak(model: torch.nn.Module, specs: list[CacheSpec], platform: Platform, rows: int, context: int,
                        block_size: int) -> int | None:
    """The allocator's peak of one decode step of ``rows`` sequences of ``context`` tokens (all
    reading one block table): what the largest captured decode graph keeps in its own memory pool,
    the graph workspace of the plan. None where the platform measures no peaks."""
    from anna.model.attention import build_metadata

    if not platform.measures_activation_peak:
        return None
    device = platform.device
    blocks = -(-context // block_size)
    caches = _profile_caches(specs, platform, blocks, block_size)
    last = context - 1
    slots = torch.full((rows,), (last // block_size) * block_size + last % block_size)
    table = torch.arange(blocks).unsqueeze(0).expand(rows, -1)
    meta = build_metadata(slots, [last] * rows, [1] * rows, table, block_size, model.config.sliding_window, device)
    meta.state_slots = torch.zeros(rows, dtype=torch.long, device=device)
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    positions = torch.full((rows,), last, device=device)
    return _peak(platform, caches, lambda: model.compute_logits(model(ids, positions, caches, meta)))


def _profile_caches(specs: list[CacheSpec], platform: Platform, blocks: int, block_size: int) -> list:
    from anna.runtime.model_runner import allocate_caches

    return allocate_caches(specs, platform, num_blocks=blocks, block_size=block_size, num_slots=1, zero=True)


def _peak(platform: Platform, caches: list, run: Callable[[], object]) -> int:
    """The allocator's peak during ``run``; then the profile's caches go back to the device (the
    plan reads the device's free memory)."""
    peak = platform.allocator_peak(run)
    caches.clear()
    platform.empty_cache()
    return peak
