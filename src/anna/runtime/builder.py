"""Builds an engine's parts from resolved settings, in order: the model's files, the platform,
the weights (with the ops the platform chose), the cache plan from the model's cache specs, the
cache managers, the scheduler, the runner, and the input side. Each component takes its
settings section whole (core/config.py, SECTION_FIELDS)."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from anna.core.config import ResolvedSettings
from anna.core.speculative import SpeculativeConfig, load_speculative_config
from anna.core.sampling_params import SamplingParams
from anna.model.cache_spec import state_layers, with_kv_cache_dtype
from anna.model.config import ModelConfig, load_generation_defaults, load_model_config
from anna.model.ops import ModelOps, QuantFormat
from anna.parallel.sharding import TensorParallelShard
from anna.parallel.workers import ParallelLayout, RankGroups, WorkerGroup, join_group, serve_node, threads_per_rank
from anna.platforms import Platform, resolve_platform
from anna.runtime.cache_managers import CacheManagers
from anna.runtime.compilation import use_inductor_cache_dir
from anna.runtime.input_processor import InputProcessor
from anna.runtime.kv_cache import KVCacheManager
from anna.runtime.memory import (CachePlan, module_bytes, plan_caches, profile_activation_peak, profile_decode_peak,
                                 resolve_dtype)
from anna.runtime.memory_release import MemoryReleaser, ReleasePolicy
from anna.runtime.metrics import EngineStats
from anna.runtime.model_runner import ModelRunner
from anna.runtime.profiler import RuntimeProfiler
from anna.runtime.prompt_cache import PromptCache
from anna.runtime.sampler import Sampler
from anna.runtime.scheduler import Scheduler, SchedulerConfig
from anna.runtime.speculative.factory import build_speculative_decoder
from anna.runtime.state_cache import StateCacheManager
from anna.runtime.structured_output import StructuredOutputCompiler
from anna.weights.chat_template import load_chat_template, template_reasoning_format, template_tool_format
from anna.weights.demo_model import DEMO_DRAFT_ALIAS, DEMO_NOTICE, ensure_demo_model
from anna.weights.gguf_checkpoint import GGUF_TYPES_KEY, find_gguf, lm_head_method, prepare_gguf_model, quant_choice
from anna.weights.loader import Int4CacheOptions, TensorParallelLoad, load_model
from anna.weights.prequantized import checkpoint_quantization
from anna.weights.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    settings: ResolvedSettings
    model_dir: str
    is_demo: bool
    model_config: ModelConfig
    tokenizer: Tokenizer
    platform: Platform
    dtype: torch.dtype
    activation_dtype: torch.dtype
    max_model_len: int
    profiler: RuntimeProfiler | None
    ops: ModelOps
    decode_executor: str  # graph | eager, as resolved
    compile_mode: str
    plan: CachePlan
    kv: KVCacheManager
    caches: CacheManagers
    prompt_cache: PromptCache
    stats: EngineStats
    scheduler: Scheduler
    runner: ModelRunner
    memory: MemoryReleaser
    inputs: InputProcessor
    calibration: Any  # what this host measured for the model (platforms/cpu/calibration.py), or None
    workers: WorkerGroup | None = None  # the other ranks of a tensor-parallel model


@dataclass
class ModelShare:
    """A rank's model (the whole model on one device) and what it runs with."""

    platform: Platform
    dtype: torch.dtype
    activation_dtype: torch.dtype
    ops: ModelOps
    model: torch.nn.Module
    specs: list  # the model's cache specs, in the KV cache dtype
    groups: RankGroups | None  # its tensor-parallel group, or None


def load_model_share(s: ResolvedSettings, model_dir: str, lm_head_quantization: str,
                     join: Callable[[torch.device], RankGroups] | None = None, *, show_progress: bool = True,
                     profiler: RuntimeProfiler | None = None, cfg: ModelConfig | None = None,
                     platform: Platform | None = None) -> ModelShare:
    """The platform, the ops and the loaded model of one rank; ``join``: meet the other ranks of a
    tensor-parallel model on this device (returns its groups), then load only this rank's share."""
    sec = s.sections
    m, cpu = sec.model, sec.cpu
    cfg = cfg or load_model_config(model_dir)
    platform = platform or resolve_platform(sec.execution.device)
    dtype = resolve_dtype(m.dtype, cfg)
    act_dtype = platform.activation_dtype(dtype)
    max_model_len = m.max_model_len or cfg.max_position_embeddings
    quant = QuantFormat(m.quantization, m.int4_group_size, lm_head_quantization, m.int8_group_size)
    ops = platform.build_ops(cpu, quant, profiler, m.cache_dir, dtype)
    groups = join(platform.device) if join is not None else None
    model = load_model(model_dir, cfg, dtype=dtype, platform=platform, ops=ops,
                       max_positions=max(max_model_len, cfg.max_position_embeddings),
                       pipeline_workers=m.weight_load_pipeline_workers, activation_dtype=act_dtype,
                       int4_cache=Int4CacheOptions(not m.disable_int4_cache, m.int4_cache_dir,
                                                   m.int4_cache_load_workers, m.cache_dir),
                       show_progress=show_progress, huge_pages=cpu.cpu_huge_pages,
                       tensor_parallel=TensorParallelLoad(groups.shard, groups.comm) if groups else None)
    specs = with_kv_cache_dtype(model.cache_specs(act_dtype), sec.cache.kv_cache_dtype)
    return ModelShare(platform, dtype, act_dtype, ops, model, specs, groups)


def build_engine_parts(s: ResolvedSettings, show_progress: bool = True, recalibrate: bool = False) -> EngineParts:
    """``recalibrate``: measure the host's routing thresholds again (anna tune), not read them."""
    started: list[WorkerGroup] = []  # the other ranks of a tensor-parallel model, stopped if the build fails
    try:
        return _build_engine_parts(s, show_progress, recalibrate, started)
    except BaseException:
        for workers in started:
            workers.close()
        raise


@dataclass(frozen=True)
class ModelSource:
    """The model directory a setting names, made ready (the demo model written, a GGUF's metadata
    as a directory), its config and the quantization resolved from it."""

    settings: ResolvedSettings
    model_dir: str
    is_demo: bool
    config: ModelConfig
    lm_head_quantization: str


def resolve_model_source(s: ResolvedSettings) -> ModelSource:
    m = s.sections.model
    is_demo = m.model is None
    model_dir = str(ensure_demo_model(m.cache_dir)) if is_demo else m.model
    if is_demo:
        log.warning("No model given: using %s (%s)", model_dir, DEMO_NOTICE)
    gguf_file = None if is_demo else find_gguf(model_dir)
    if gguf_file is not None:  # its metadata as a model directory in the cache
        model_dir = str(prepare_gguf_model(gguf_file, m.cache_dir, need_tokenizer=not m.tokenizer))
    cfg = load_model_config(model_dir)
    s, lm_head_quantization = _resolve_quantization(s, cfg, model_dir)
    return ModelSource(s, model_dir, is_demo, cfg, lm_head_quantization)


def serve_node_ranks(s: ResolvedSettings) -> int:
    """A node other than 0 of a tensor-parallel model: run this node's ranks until they end."""
    source = resolve_model_source(s)
    TensorParallelShard(0, s.tensor_parallel_size).check(source.config)
    return serve_node(source.settings, source.model_dir, source.lm_head_quantization)


def _build_engine_parts(s: ResolvedSettings, show_progress: bool, recalibrate: bool,
                        started: list[WorkerGroup]) -> EngineParts:
    if s.node_rank > 0:
        raise ValueError(f"node_rank: node {s.node_rank} runs only its ranks' share of the model (anna serve "
                         f"--node-rank {s.node_rank} does that); the engine runs on node 0")
    source = resolve_model_source(s)
    s, model_dir, is_demo, cfg = source.settings, source.model_dir, source.is_demo, source.config
    lm_head_quantization = source.lm_head_quantization
    sec = s.sections
    m, c, sch, ex, cpu = sec.model, sec.cache, sec.scheduler, sec.execution, sec.cpu
    spec_config = load_speculative_config(sch.speculative_config)
    if spec_config is not None and spec_config.model == DEMO_DRAFT_ALIAS:
        spec_config = dataclasses.replace(spec_config, model=str(ensure_demo_model(m.cache_dir, draft=True)))
    if spec_config is not None and spec_config.method == "mtp":
        if not cfg.mtp_num_hidden_layers:
            raise ValueError(f"speculative_config.method: mtp needs a checkpoint with a multi-token-prediction "
                             f"head (mtp_num_hidden_layers in config.json and mtp.* tensors); {cfg.architecture} "
                             f"at {model_dir} has none")
        cfg = dataclasses.replace(cfg, load_mtp=True)
    tokenizer = Tokenizer(m.tokenizer or model_dir)
    if m.chat_template:
        tokenizer.chat_template = load_chat_template(m.chat_template)
    max_model_len = m.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings and cfg.rope_scaling is None:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    s = _resolve_output_parsers(s, tokenizer.chat_template)
    sampling_defaults = _sampling_defaults(m.generation_config, model_dir)
    platform = resolve_platform(ex.device)
    profiler = RuntimeProfiler(platform) if ex.profile_runtime else None
    workers = join = None
    if s.tensor_parallel_size > 1:
        s, layout = check_tensor_parallel(s, cfg, spec_config)
        workers = WorkerGroup.start(layout, s, model_dir, lm_head_quantization)
        started.append(workers)
        join = partial(join_group, workers.layout, 0, alive=lambda: workers.dead is None)
        ex, c = s.sections.execution, s.sections.cache
    share = load_model_share(s, model_dir, lm_head_quantization, join, show_progress=show_progress,
                             profiler=profiler, cfg=cfg, platform=platform)
    platform, dtype, act_dtype, ops, model, specs = (share.platform, share.dtype, share.activation_dtype, share.ops,
                                                     share.model, share.specs)
    calibration = platform.calibrate(model, ops, cpu, cache_dir=m.cache_dir, refresh=recalibrate,
                                     max_chunk=sch.max_num_batched_tokens,
                                     max_rows=sch.max_num_seqs) if cpu.calibrate or recalibrate else None
    s = _apply_calibration(s, ops, calibration)
    sch = s.sections.scheduler
    log.info("Resolved settings:\n%s", s.table())
    if workers is not None:
        workers.attach(share.groups)
        workers.send("set_routing", ops.routing)
        log.info(describe_layout(workers.layout, cfg, model.config, threads_per_rank(workers.layout)))

    def decode_executor_for(m: torch.nn.Module):
        return platform.decode_executor(ex.decode_executor, m, ops, profiling=profiler is not None,
                                        max_num_seqs=sch.max_num_seqs, max_model_len=max_model_len,
                                        block_size=c.block_size)

    executor = decode_executor_for(model)
    speculative = None
    if spec_config is not None:
        speculative = build_speculative_decoder(
            spec_config, target=model, target_config=cfg, platform=platform, block_size=c.block_size,
            activation_dtype=act_dtype, executor=decode_executor_for,
            load=lambda where, draft_cfg: load_model(
                where, draft_cfg, dtype=dtype, platform=platform, ops=ops,
                max_positions=max(max_model_len, draft_cfg.max_position_embeddings),
                pipeline_workers=m.weight_load_pipeline_workers, activation_dtype=act_dtype,
                show_progress=show_progress, huge_pages=cpu.cpu_huge_pages))
    proposer_specs = list(getattr(speculative.proposer, "cache_specs", [])) if speculative else []
    if proposer_specs:  # a draft model's or MTP layer's KV: stored as the target's
        proposer_specs = speculative.proposer.cache_specs = with_kv_cache_dtype(proposer_specs, c.kv_cache_dtype)
    executor_name = "graph" if executor is not None else "eager"
    log.info("Decode executor: %s", executor_name)
    profile_tokens = min(sch.max_num_batched_tokens, max_model_len)  # the largest prefill one step runs
    if workers is not None and platform.measures_activation_peak:  # the profile's collectives meet on every rank
        workers.send("profile", "profile_activation_peak", profile_tokens, min(sch.max_num_seqs, profile_tokens),
                     c.block_size)
    peak = profile_activation_peak(model, specs, platform, profile_tokens, min(sch.max_num_seqs, profile_tokens),
                                   c.block_size)
    workspace = profile_decode_peak(model, specs, platform, sch.max_num_seqs, max_model_len, c.block_size) \
        if executor is not None and executor.spare_blocks else None
    plan = plan_caches(specs + proposer_specs, platform, block_size=c.block_size, max_model_len=max_model_len,
                       kv_cache_memory_gib=c.kv_cache_memory, num_blocks_override=c.num_gpu_blocks_override,
                       memory_utilization=c.memory_utilization, max_num_seqs=sch.max_num_seqs,
                       weights=module_bytes(model), activation_peak=peak, profile_tokens=profile_tokens,
                       workspace_bytes=workspace or 0, state_snapshots=_state_snapshots(c, sch),
                       snapshots_auto=c.state_snapshots < 0,
                       state_checkpoints=_state_checkpoints(spec_config, sch.max_num_seqs),
                       ranks_sharing_memory=workers.layout.ranks_per_node
                       if workers is not None and platform.ranks_share_memory else 1)
    log.info(plan.describe(max_model_len) + (f"\n  (per rank: each of the {s.tensor_parallel_size} ranks keeps these "
                                             f"blocks for its own KV heads)" if workers is not None else ""))
    kv = KVCacheManager(plan.num_blocks, c.block_size, c.enable_prefix_caching)
    caches = CacheManagers(kv, StateCacheManager(plan.num_state_slots, plan.num_state_snapshots,
                                                 plan.num_state_checkpoints) if state_layers(specs) else None)
    prompt_cache = _prompt_cache(c, caches, plan.kv_formats)
    stats = EngineStats()
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=sch.max_num_seqs, max_num_batched_tokens=sch.max_num_batched_tokens,
        long_prefill_token_threshold=sch.long_prefill_token_threshold,
        prefill_interval_steps=sch.prefill_interval_steps,
        event_driven_prefill_insert=sch.scheduler_event_driven_prefill_insert,
        num_lookahead_tokens=speculative.proposer.lookahead if speculative else 0,
        speculation_max_batch=spec_config.disable_by_batch_size if spec_config else 0), caches, prompt_cache, stats,
        max_model_len)
    compile_mode = platform.auto_compile_mode if ex.compile_mode == "auto" else ex.compile_mode
    if compile_mode != "none":
        log.info("torch.compile: mode=%s fullgraph=%s, cache %s", compile_mode, ex.compile_fullgraph,
                 use_inductor_cache_dir(ex.torchinductor_cache_dir))
    runner = ModelRunner(model, caches, platform, specs, Sampler(m.seed, platform.device, argmax=ops.argmax),
                         compile_mode=compile_mode, compile_fullgraph=ex.compile_fullgraph, decode_executor=executor,
                         huge_pages=cpu.cpu_huge_pages, profiler=profiler, max_model_len=max_model_len,
                         speculative=speculative, workers=workers)
    floor = c.memory_release_min_free_mib if c.memory_release_min_free_mib >= 0 else c.min_free_memory_mib
    memory = MemoryReleaser(kv, runner.kv_caches, prompt_cache, platform, c.kv_release_chunk_blocks,
                            ReleasePolicy(c.memory_release_sweep_interval_s, floor, c.memory_release_max_gap_mib,
                                          c.kv_commit_ahead_mib),
                            workers)
    eos = frozenset(cfg.eos_token_ids or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []))
    structured = StructuredOutputCompiler(tokenizer.to_json(), cfg.vocab_size, sorted(eos),
                                          cache_size=m.structured_output_cache_size,
                                          max_spec_bytes=m.structured_output_max_bytes)
    sync_every = sch.scheduler_token_sync_every_steps or (1 if not platform.asynchronous else 8)
    if speculative is not None and sync_every != 1:  # proposals are made from the tokens on the host
        log.info("Token sync window: 1 step (speculative decoding proposes from every step's tokens)")
        sync_every = 1
    if speculative is not None:
        log.info("Speculative decoding: %s", spec_config.to_json())
    inputs = InputProcessor(tokenizer, cfg, max_model_len, eos, structured, sync_every, sampling_defaults)
    return EngineParts(s, model_dir, is_demo, cfg, tokenizer, platform, dtype, act_dtype, max_model_len, profiler,
                       ops, executor_name, compile_mode, plan, kv, caches, prompt_cache, stats, scheduler, runner,
                       memory, inputs, calibration, workers)


def check_tensor_parallel(s: ResolvedSettings, cfg: ModelConfig,
                          spec_config: SpeculativeConfig | None) -> tuple[ResolvedSettings, ParallelLayout]:
    """Refuse what a tensor-parallel engine does not run (naming the setting); turn off what runs
    on one rank only (the fused CPU decode stack and CUDA graphs, which have no collectives inside;
    torch.compile), saying so in the settings table."""
    layout = ParallelLayout.from_settings(s.sections.parallel)
    TensorParallelShard(0, layout.size).check(cfg)
    if spec_config is not None and spec_config.method != "ngram":
        raise ValueError(f"speculative_config: method {spec_config.method} runs a second model, which is not split "
                         f"across tensor-parallel ranks yet; ngram works with tensor_parallel_size > 1")
    if s.prompt_cache_size > 0:
        raise ValueError("prompt_cache_size: the exact prompt cache keeps one rank's KV; with tensor_parallel_size > 1 "
                         "repeated prompts are served by prefix caching (prompt_cache_size 0 or -1)")
    why = "tensor parallel: the ranks' collectives run between the layers"
    if s.decode_executor == "graph":
        raise ValueError("decode_executor: graph (the fused CPU decode stack, CUDA graphs) has no collectives "
                         "between its layers; use eager or auto with tensor_parallel_size > 1")
    if s.decode_executor == "auto":
        s = s.with_value("decode_executor", "eager", f"{s.sources['decode_executor']}: auto, {why}")
    if s.compile_mode not in ("none", "auto"):
        raise ValueError("compile_mode: torch.compile is not used with tensor_parallel_size > 1 yet (none or auto)")
    if s.compile_mode == "auto":
        s = s.with_value("compile_mode", "none", f"{s.sources['compile_mode']}: auto, {why}")
    return s, layout.with_free_port()


def describe_layout(layout: ParallelLayout, cfg: ModelConfig, local: ModelConfig, threads: int) -> str:
    """The start-up log's rank layout: where the ranks are and what each keeps."""
    kv = f"{local.num_key_value_heads} of {cfg.num_key_value_heads}" + \
        (" (replicated)" if cfg.num_key_value_heads < layout.size else "")
    lines = [f"{layout.size} ranks on {layout.nnodes} node(s) ({layout.ranks_per_node} per node, "
             f"{layout.backend}), meeting at {layout.master_addr}:{layout.master_port}; rank 0 here, "
             f"{threads} CPU thread(s) per rank on CPU",
             f"each rank: {local.num_attention_heads} of {cfg.num_attention_heads} query heads, {kv} KV heads, "
             f"{local.intermediate_size} of {cfg.intermediate_size} MLP columns"
             + (f", {local.moe.intermediate_size} of {cfg.moe.intermediate_size} columns of each of "
                f"{cfg.moe.num_experts} experts" if cfg.moe else "")
             + f", {local.vocab_size} of {cfg.vocab_size} vocabulary rows; each logs its own weight bytes"]
    return "Tensor parallel:\n" + "\n".join(f"  {line}" for line in lines)


def _apply_calibration(s: ResolvedSettings, ops: ModelOps, calibration: Any) -> ResolvedSettings:
    """The calibrated values as the default layer: each replaces a built-in default (the chunk
    size: the throughput profile's), never a value given by flag, keyword or ANNA_* variable."""
    if calibration is None:
        return s
    from anna.platforms.cpu.calibration import ROUTING_FIELDS

    routing = {}
    for name, value in sorted(calibration.values.items()):
        source = s.sources[name]
        if source == "default" or (name == "long_prefill_token_threshold" and source == "profile"
                                   and s.scheduler_profile == "throughput"):
            s = s.with_value(name, value, "calibrated")
            if name in ROUTING_FIELDS:
                routing[ROUTING_FIELDS[name]] = value
    ops.routing = dataclasses.replace(ops.routing, **routing)
    return s


def _resolve_quantization(s: ResolvedSettings, cfg: ModelConfig, model_dir: str) -> tuple[ResolvedSettings, str]:
    """quantization ``auto``: the checkpoint's own format (and its int4 group, unless one was set);
    also the lm_head's method where the checkpoint gives it one of its own ("": the layers')."""
    quant = checkpoint_quantization(cfg.raw, f"{model_dir}/config.json")  # refuses what Anna cannot run
    if s.quantization != "auto":
        return s, ""
    lm_head = ""
    if GGUF_TYPES_KEY in cfg.raw:
        choice = quant_choice(Counter(cfg.raw[GGUF_TYPES_KEY]))
        method, group, why = choice.method, choice.group, choice.why
        lm_head = lm_head_method(cfg.raw)
    elif quant is not None:
        method, group, why = quant.auto_format()
        lm_head = method if quant.quantizes_lm_head else "none"
    else:
        method, group, why = "none", s.int4_group_size, "a float checkpoint"
    if lm_head and lm_head != method:
        why += f"; lm_head {lm_head}, as the checkpoint keeps it"
    else:
        lm_head = ""
    s = s.with_value("quantization", method, f"{s.sources['quantization']}: auto, {why}")
    for fmt in {method, lm_head} & {"int4", "int8"}:  # the checkpoint's group, unless one was set
        name = f"{fmt}_group_size"
        if s.sources[name] == "default" and group != getattr(s, name):
            s = s.with_value(name, group, "the checkpoint's")
    return s, lm_head


def _resolve_output_parsers(s: ResolvedSettings, template: str | None) -> ResolvedSettings:
    """tool_call_parser and reasoning_parser ``auto``: the formats the chat template uses."""
    for name, detect in (("tool_call_parser", template_tool_format), ("reasoning_parser", template_reasoning_format)):
        if getattr(s, name) == "auto":
            choice, why = detect(template)
            s = s.with_value(name, choice, f"{s.sources[name]}: auto, {why}")
    return s


def _sampling_defaults(where: str, model_dir: str) -> dict[str, Any]:
    """The sampling parameters a request gets for the fields it leaves out, as vLLM takes them
    from the model's generation_config.json (see the generation_config setting)."""
    if where == "none":
        return {}
    folder = model_dir if where == "auto" else where
    if where != "auto" and not Path(folder, "generation_config.json").is_file():
        raise ValueError(f"generation_config: {folder} holds no generation_config.json")
    defaults = load_generation_defaults(folder)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"generation_config: {folder}/generation_config.json: {exc}") from None
    if defaults:
        log.info("Default sampling parameters from %s/generation_config.json: %s (generation_config=none: "
                 "Anna's own)", folder, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def _state_snapshots(c: Any, sch: Any) -> int:
    """States kept for prefix reuse of recurrent layers: none without prefix caching."""
    if not c.enable_prefix_caching:
        return 0
    return c.state_snapshots if c.state_snapshots >= 0 else sch.max_num_seqs


def _state_checkpoints(spec: SpeculativeConfig | None, max_num_seqs: int) -> int:
    """Recurrent layers' states kept after each verified token (to roll back to): K for each
    sequence that may speculate in one step (max_num_seqs, or disable_by_batch_size when lower)."""
    if spec is None:
        return 0
    seqs = min(max_num_seqs, spec.disable_by_batch_size) if spec.disable_by_batch_size else max_num_seqs
    return seqs * spec.num_speculative_tokens


def _prompt_cache(c: Any, caches: CacheManagers, kv_formats: str) -> PromptCache:
    """Resolve the exact prompt cache's auto values from the cache kinds: it is on by default
    (4 entries of at most 2,048 tokens) where cached rows cannot be shared through paged prefix
    blocks, off where they can (with recurrent layers, they can when their states are
    snapshotted: state_snapshots). Every KV cache dtype is shared through paged blocks: a block
    keeps its rows as stored, scales and norms included, under the same hash."""
    size = c.prompt_cache_size if c.prompt_cache_size >= 0 else (0 if caches.shares_prefixes else 4)
    why = "" if size or c.prompt_cache_size >= 0 else \
        f" (off: paged prefix blocks serve repeated prompts; KV stored as {kv_formats} is shared through them)"
    if size and caches.state is not None:  # its entries hold paged KV only
        size, why = 0, " (off: its entries hold no per-sequence state of recurrent layers)"
    on_by_default = c.prompt_cache_size < 0 and size > 0
    max_tokens = c.prompt_cache_max_tokens if c.prompt_cache_max_tokens >= 0 else (2048 if on_by_default else 0)
    log.info("Exact prompt cache: size=%d max_tokens=%d%s", size, max_tokens, why or ("" if size else " (off)"))
    return PromptCache(size, max_tokens)
