"""The engine loop: ``step()`` = schedule -> execute -> process outputs.

Requests may be added and aborted between any two steps. A request with ``n > 1`` runs as n
sequences that share the prompt's KV blocks through the prefix cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anna.core.config import ResolvedSettings, ServeSettings
from anna.core.errors import EngineDeadError, RequestError
from anna.core.outputs import CompletionOutput, Logprob, RequestOutput
from anna.core.request import PENDING_TOKEN, Request, RequestStatus
from anna.core.sampling_params import SamplingParams
from anna.model.config import load_generation_defaults, load_model_config
from anna.model.cpu_kernels import build_cpu_kernels
from anna.model.linear import KernelPolicy
from anna.runtime.compilation import resolve_compile_mode, resolve_decode_executor, use_inductor_cache_dir
from anna.runtime.kv_cache import KVCacheManager
from anna.runtime.memory import (activation_dtype, module_bytes, plan_kv_cache, profile_activation_peak,
                                 profile_decode_peak, resolve_device, resolve_dtype)
from anna.runtime.memory_release import MemoryReleaser, ReleasePolicy
from anna.runtime.metrics import EngineStats
from anna.runtime.model_runner import ModelRunner, StepResult
from anna.runtime.profiler import RuntimeProfiler
from anna.runtime.prompt_cache import PromptCache
from anna.runtime.sampler import Sampler
from anna.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from anna.runtime.structured_output import StructuredOutputCompiler
from anna.weights.chat_template import load_chat_template
from anna.weights.demo_model import DEMO_NOTICE, ensure_demo_model
from anna.weights.loader import Int4CacheOptions, load_model
from anna.weights.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """Engine-side state of one sequence: the request plus its text."""

    req: Request
    detok: IncrementalDetokenizer | None
    text: str = ""


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    final_only: bool = False  # one output, when finished
    seqs: list[SequenceState] = field(default_factory=list)
    error: RequestError | None = None  # why it failed, if it did (all its sequences end with it)

    @property
    def finished(self) -> bool:
        return all(s.req.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, settings: ServeSettings | ResolvedSettings, *, show_progress: bool = True) -> None:
        s = settings if isinstance(settings, ResolvedSettings) else settings.resolve()
        self.settings = s
        self.is_demo = s.model is None
        self.model_dir = str(ensure_demo_model(s.cache_dir)) if self.is_demo else s.model
        if self.is_demo:
            log.warning("No model given: using %s (%s)", self.model_dir, DEMO_NOTICE)
        self.model_config = cfg = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer(s.tokenizer or self.model_dir)
        if s.chat_template:
            self.tokenizer.chat_template = load_chat_template(s.chat_template)
        self.device = resolve_device(s.device)
        self.dtype = resolve_dtype(s.dtype, cfg)
        self.activation_dtype = activation_dtype(self.dtype, self.device)
        self.max_model_len = s.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings and cfg.rope_scaling is None:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        log.info("Resolved settings:\n%s", s.table())
        self.sampling_defaults = self._sampling_defaults()
        self.profiler = RuntimeProfiler(self.device) if s.profile_runtime else None
        policy = self._kernel_policy(moe=cfg.moe is not None)
        model = load_model(self.model_dir, cfg, dtype=self.dtype, device=self.device,
                           max_positions=max(self.max_model_len, cfg.max_position_embeddings),
                           pipeline_workers=s.weight_load_pipeline_workers, policy=policy,
                           activation_dtype=self.activation_dtype,
                           int4_cache=Int4CacheOptions(not s.disable_int4_cache, s.int4_cache_dir,
                                                       s.int4_cache_load_workers, s.cache_dir),
                           show_progress=show_progress, huge_pages=s.cpu_huge_pages)
        profile_tokens = min(s.max_num_batched_tokens, self.max_model_len)  # the largest prefill one step runs
        peak = profile_activation_peak(model, cfg, profile_tokens, min(s.max_num_seqs, profile_tokens), s.block_size,
                                       self.device, self.activation_dtype)
        graph_decode = self.decode_executor == "graph" and self.device.type == "cuda"
        graph_workspace = profile_decode_peak(model, cfg, s.max_num_seqs, self.max_model_len, s.block_size,
                                              self.device, self.activation_dtype) if graph_decode else None
        plan = plan_kv_cache(cfg, self.activation_dtype, self.device, block_size=s.block_size,
                             max_model_len=self.max_model_len, kv_cache_memory_gib=s.kv_cache_memory,
                             num_blocks_override=s.num_gpu_blocks_override, memory_utilization=s.memory_utilization,
                             max_num_seqs=s.max_num_seqs, weights=module_bytes(model), activation_peak=peak,
                             profile_tokens=profile_tokens, workspace_bytes=graph_workspace or 0)
        log.info(plan.describe(self.max_model_len))
        self.kv = KVCacheManager(plan.num_blocks, s.block_size, s.enable_prefix_caching)
        self.prompt_cache = self._prompt_cache()
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            long_prefill_token_threshold=s.long_prefill_token_threshold,
            prefill_interval_steps=s.prefill_interval_steps,
            event_driven_prefill_insert=s.scheduler_event_driven_prefill_insert), self.kv, self.prompt_cache)
        self.compile_mode = resolve_compile_mode(s.compile_mode, self.device)
        if self.compile_mode != "none":
            log.info("torch.compile: mode=%s fullgraph=%s, cache %s", self.compile_mode, s.compile_fullgraph,
                     use_inductor_cache_dir(s.torchinductor_cache_dir))
        sampler = Sampler(s.seed, self.device, argmax=policy.cpu.argmax if policy.cpu is not None else None)
        self.runner = ModelRunner(model, self.kv, self.device, self.activation_dtype, sampler, self.compile_mode,
                                  s.compile_fullgraph, graph_decode=graph_decode, max_num_seqs=s.max_num_seqs,
                                  max_model_len=self.max_model_len, huge_pages=s.cpu_huge_pages)
        floor = s.memory_release_min_free_mib if s.memory_release_min_free_mib >= 0 else s.min_free_memory_mib
        self.memory = MemoryReleaser(
            self.kv, self.runner.kv_caches, self.prompt_cache, self.device, s.kv_release_chunk_blocks,
            ReleasePolicy(s.memory_release_sweep_interval_s, floor, s.memory_release_max_gap_mib))
        self.eos_token_ids = frozenset(cfg.eos_token_ids or
                                       ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []))
        self.token_sync_every = s.scheduler_token_sync_every_steps or (1 if self.device.type == "cpu" else 8)
        self.structured = StructuredOutputCompiler(
            self.tokenizer.to_json(), cfg.vocab_size, sorted(self.eos_token_ids),
            cache_size=s.structured_output_cache_size, max_spec_bytes=s.structured_output_max_bytes)
        self.stats = EngineStats()
        self.groups: dict[str, RequestGroup] = {}
        self._seqs: dict[str, tuple[RequestGroup, SequenceState]] = {}

    def _kernel_policy(self, moe: bool) -> KernelPolicy:
        s = self.settings
        cpu = (build_cpu_kernels(s.cache_dir, s.cpu_kernel_compiler) if s.cpu_kernels and self.device.type == "cpu"
               else None)
        if self.device.type == "cpu":
            log.info("CPU kernels: %s", f"Anna's (matmuls up to M={s.cpu_gemv_max_rows})" if cpu else "torch's")
        self.decode_executor = resolve_decode_executor(s.decode_executor, self.device, cpu is not None,
                                                       profiling=self.profiler is not None, moe=moe)
        log.info("Decode executor: %s", self.decode_executor)
        return KernelPolicy(cpu=cpu, cpu_gemv_max_rows=s.cpu_gemv_max_rows, cpu_upcast_min_rows=s.cpu_upcast_min_rows,
                            quantization=s.quantization, int4_group_size=s.int4_group_size,
                            int4_matmul=s.int4_matmul, int4_gemv_m_threshold=s.int4_gemv_m_threshold,
                            profiler=self.profiler,
                            fused_decode=self.decode_executor == "graph" and self.device.type == "cpu")

    def _sampling_defaults(self) -> dict[str, Any]:
        """The sampling parameters a request gets for the fields it leaves out, as vLLM takes them
        from the model's generation_config.json (see the generation_config setting)."""
        where = self.settings.generation_config
        if where == "none":
            return {}
        folder = self.model_dir if where == "auto" else where
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

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_defaults)

    def _prompt_cache(self) -> PromptCache:
        """Resolve the exact prompt cache's auto values. Anna's KV layout is paged, so by default
        block sharing serves repeated prompts and this cache is off."""
        s = self.settings
        kv_paged = True
        size = s.prompt_cache_size if s.prompt_cache_size >= 0 else (0 if kv_paged else 4)
        on_by_default = s.prompt_cache_size < 0 and size > 0
        max_tokens = s.prompt_cache_max_tokens if s.prompt_cache_max_tokens >= 0 else (2048 if on_by_default else 0)
        log.info("Exact prompt cache: size=%d max_tokens=%d%s", size, max_tokens, "" if size else " (off)")
        return PromptCache(size, max_tokens)

    # ---- requests ----
    def encode_prompt(self, prompt: str | list[int],
                      truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; with truncate_prompt_tokens, only its last that many
        tokens (and no text, which would no longer match them)."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in prompt):
            raise ValueError("prompt: must be a string or a list of token ids")
        else:
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
            text, ids = None, list(prompt)
        if truncate_prompt_tokens is not None and len(ids) > truncate_prompt_tokens:
            text, ids = None, ids[-truncate_prompt_tokens:]
        return text, ids

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Check what SamplingParams cannot check alone (lengths against max_model_len, token ids
        against the vocabulary); return the effective max_tokens. (The KV plan guarantees that the
        pool holds at least one max_model_len sequence, so a request that passes always fits.)"""
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary (0..{vocab - 1})")
        if num_prompt_tokens == 0:
            raise ValueError("prompt: must not be empty")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt: the prompt has {num_prompt_tokens} tokens; with max_model_len={self.max_model_len} "
                f"it may have at most {self.max_model_len - 1}, to leave room for one generated token")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, "
                f"{num_prompt_tokens + max_tokens} in all, more than max_model_len={self.max_model_len}")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens: {params.min_tokens} is more than the {max_tokens} tokens this request "
                             "may generate")
        return max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text, ids = self.encode_prompt(prompt, params.truncate_prompt_tokens)
        max_tokens = self.check_request(len(ids), params)
        spec = params.structured_outputs
        if spec is not None:
            self.structured.compile(spec)  # invalid constraints fail here, before anything is allocated
        group = RequestGroup(request_id, text, final_only=params.output_kind == "final_only")
        sync_every = self._sync_window(params)
        bad_word_ids = self._bad_word_ids(params.bad_words or [])
        if params.allowed_token_ids and set(params.allowed_token_ids) <= {w[0] for w in bad_word_ids if len(w) == 1}:
            raise ValueError("allowed_token_ids: every allowed token is one of the bad_words, so no token could "
                             "ever be generated")
        for i in range(params.n):
            child = params
            if params.n > 1 or params.max_tokens != max_tokens:
                child = SamplingParams(**{**_fields(params), "n": 1, "max_tokens": max_tokens,
                                          "seed": None if params.seed is None else (params.seed + i) % 2**64,
                                          "prompt_logprobs": params.prompt_logprobs if i == 0 else None})
            req = Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, child, prompt=text,
                          eos_token_ids=self.eos_token_ids, arrival_time=arrival_time or time.monotonic(),
                          grammar=None if spec is None else self.structured.new_matcher(spec), sync_every=sync_every,
                          bad_word_ids=bad_word_ids)
            detok = IncrementalDetokenizer(self.tokenizer, ids, child.skip_special_tokens)
            group.seqs.append(SequenceState(req, detok))
        self.groups[request_id] = group  # registered only once every sequence is built
        for state in group.seqs:
            self._seqs[state.req.request_id] = (group, state)
            self.scheduler.add(state.req)
        self.stats.prompt_tokens += len(ids) * params.n

    def _sync_window(self, p: SamplingParams) -> int:
        """Steps between reading a request's tokens back: 1 unless nobody looks at them sooner
        (no stream, stop strings, logprobs, penalties, bad words or grammar, which need each token)."""
        if (p.output_kind != "final_only" or p.stop_strings or p.logprobs is not None
                or p.structured_outputs is not None or p.repetition_penalty != 1.0 or p.presence_penalty
                or p.frequency_penalty or p.bad_words):
            return 1
        return self.token_sync_every

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the tokens it is generated as: on its own and after a space (which
        most tokenizers fold into the word's first token), as vLLM reads bad_words."""
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for state in group.seqs:
            self._finish(state, "abort")
            self._seqs.pop(state.req.request_id, None)

    def reset_stats(self) -> None:
        """Forget the counters and histograms (after warmup)."""
        self.stats = EngineStats()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run -> process outputs. A failure is confined to the requests it
        belongs to (they end with a RequestError); the engine raises only EngineDeadError, when
        it cannot serve anything any more."""
        start = time.perf_counter() if self.profiler is None else self.profiler.step_started()
        touched: dict[str, RequestGroup] = {}
        try:
            batch = self.scheduler.schedule()
        except Exception as exc:  # a scheduling bug: no request can be blamed, so none may stay
            log.exception("scheduling failed: failing every queued request")
            self._fail_unattributed(self.scheduler.running + list(self.scheduler.waiting), exc, touched)
            return self._outputs(touched)
        if not batch:
            return []
        try:
            result = self.runner.execute(batch)
        except Exception as exc:
            log.exception("step failed (%d requests, %d tokens): failing its requests", len(batch.requests),
                          batch.total_tokens)
            self._fail_unattributed(batch.requests, exc, touched)
            return self._outputs(touched)
        self.stats.steps.record(batch.step_class, time.perf_counter() - start)
        if self.profiler is not None:
            self.profiler.step_finished(start)
        to_sync: list[SequenceState] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.is_finished:  # failed with another sequence of its group in this step
                continue
            error = result.failed.get(req.request_id)
            if error is None:
                try:
                    self._process_step_output(req, n, result, to_sync, touched)
                    continue
                except Exception as exc:
                    log.exception("request %s: processing its step output failed", req.request_id)
                    error = RequestError.internal(exc)
            self._fail(req, error, touched)
        if to_sync:
            try:
                self._sync_tokens(to_sync)
            except Exception as exc:  # reading back from the device failed: it may be gone
                log.exception("reading sampled tokens back failed")
                self._fail_unattributed([state.req for state in to_sync], exc, touched)
        return self._outputs(touched)

    def _process_step_output(self, req: Request, n: int, result: StepResult, to_sync: list[SequenceState],
                             touched: dict[str, RequestGroup]) -> None:
        req.num_computed_tokens += n
        if req.request_id in result.prompt_logprobs:
            first, entries = result.prompt_logprobs[req.request_id]
            for pos, (chosen, top) in enumerate(entries, first):
                req.prompt_logprobs[pos] = logprob_entry(req.prompt_token_ids[pos], chosen, top)
        token = result.sampled.get(req.request_id)
        if token is None:
            return
        if req.num_output_tokens == 0 and self.prompt_cache.covers(req.prompt_token_ids) \
                and req.prompt_token_ids not in self.prompt_cache:
            self.prompt_cache.insert(req.prompt_token_ids, self.runner.read_prompt_kv(req))
        group, state = self._seqs[req.request_id]
        if token.value is None:  # stays on the device for now
            req.append_output_token(PENDING_TOKEN)
            req.pending.append(token.ref)
            self._record_token(req)
            if len(req.pending) >= req.sync_every or req.num_output_tokens >= req.sampling_params.max_tokens \
                    or req.num_tokens >= self.max_model_len:
                to_sync.append(state)
        else:
            self._append_token(state, token.value, token.logprobs)
        touched[group.request_id] = group

    def _outputs(self, touched: dict[str, RequestGroup]) -> list[RequestOutput]:
        outputs = []
        finished_any = False
        for group in touched.values():
            if group.final_only and not group.finished:
                continue
            try:
                outputs.append(self._make_output(group))
            except Exception as exc:
                log.exception("request %s: building its output failed", group.request_id)
                self._fail(group.seqs[0].req, RequestError.internal(exc), {})
                outputs.append(self._error_output(group))
            if group.finished:
                finished_any = True
                self.groups.pop(group.request_id, None)
                for state in group.seqs:
                    self._seqs.pop(state.req.request_id, None)
        if finished_any and not self.scheduler.has_work():
            self.memory.maybe_release(idle=True, periodic=False)
        return outputs

    # ---- failures ----
    def _fail(self, req: Request, error: RequestError, touched: dict[str, RequestGroup]) -> None:
        """End the request this sequence belongs to, all its sequences, with ``error``."""
        entry = self._seqs.get(req.request_id)
        if entry is None:  # not (or no longer) one of ours: just let its blocks go
            self.scheduler.remove(req)
            return
        group = entry[0]
        if group.error is None:
            group.error = error
            self.stats.failed[error.status] += 1
            log.log(logging.WARNING if error.status >= 500 else logging.INFO, "request %s failed (%d): %s",
                    group.request_id, error.status, error.message)
        for state in group.seqs:
            self._finish(state, "error")
        touched[group.request_id] = group

    def _fail_unattributed(self, requests: list[Request], exc: Exception, touched: dict[str, RequestGroup]) -> None:
        """A step failed and no single request can be blamed: fail the requests in it, forget the
        prefix-cache entries of the blocks it was writing, then make sure the engine still runs."""
        self.stats.failed_steps += 1
        bs = self.kv.block_size
        unwritten = [b for req in requests for b in self.kv.block_ids(req.request_id)[req.num_computed_tokens // bs:]]
        error = RequestError.internal(exc)
        for req in list(requests):
            self._fail(req, error, touched)
        self.kv.pool.uncache(unwritten)
        self._check_alive(exc)

    def _check_alive(self, cause: Exception) -> None:
        """After a failed step: raise EngineDeadError unless the device answers and a one-token
        forward pass still runs."""
        try:
            self.runner.check_device()
            self._probe()
        except Exception as exc:
            log.exception("the engine cannot run any more")
            raise EngineDeadError(f"the engine cannot run any more: {type(exc).__name__}: {exc} "
                                  f"(after a failed step: {type(cause).__name__}: {cause})") from exc

    def _probe(self) -> None:
        """One greedy token from a one-token prompt through the real runner, outside the queues."""
        req = Request("anna-probe", [0], SamplingParams(temperature=0.0, max_tokens=1))
        if not self.kv.allocate_slots(req, 1):
            return  # every block is in use by running requests: they show soon enough whether it works
        try:
            result = self.runner.execute(ScheduledBatch(requests=[req], num_new_tokens=[1]))
            if req.request_id not in result.sampled:
                raise RuntimeError(f"the probe got no token: {result.failed.get(req.request_id)}")
        finally:
            blocks = self.kv.block_ids(req.request_id)
            self.kv.free(req)
            self.kv.pool.uncache(blocks)
            self.runner.sampler.forget(req.request_id)

    def _error_output(self, group: RequestGroup) -> RequestOutput:
        first = group.seqs[0].req
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids,
                             [CompletionOutput(i, "", [], "error") for i in range(len(group.seqs))], True,
                             error=group.error)

    def _sync_tokens(self, states: list[SequenceState]) -> None:
        """Read the pending tokens of these sequences back in one copy, then check them in order as
        if each had arrived on its own step; tokens after a stop are discarded."""
        refs = [ref for state in states for ref in state.req.pending]
        values = torch.stack([t[row] for t, row in refs]).tolist()
        offset = 0
        for state in states:
            req = state.req
            n = len(req.pending)
            tokens, offset = values[offset:offset + n], offset + n
            req.pending.clear()
            del req.output_token_ids[-n:], req.all_token_ids[-n:]
            for i, token in enumerate(tokens):
                self._append_token(state, token, None, record=False)
                if req.is_finished:
                    self.stats.generation_tokens -= n - i - 1  # computed past the stop, then dropped
                    break

    def _record_token(self, req: Request) -> None:
        """Count a new output token and its timing, when it is sampled."""
        self.stats.generation_tokens += 1
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.ttft.observe(now - req.arrival_time)
            if req.first_scheduled_time is not None:
                self.stats.queue.observe(req.first_scheduled_time - req.arrival_time)
                self.stats.prefill.observe(now - req.first_scheduled_time)
        else:
            self.stats.inter_token.observe(now - req.last_token_time)
        req.last_token_time = now

    def _append_token(self, state: SequenceState, token: int, logprobs: tuple | None, record: bool = True) -> None:
        req = state.req
        p = req.sampling_params
        req.append_output_token(token)
        if record:
            self._record_token(req)
        if logprobs is not None:  # shaped once per token, not on every output
            req.output_logprobs.append(logprob_entry(token, *logprobs))
        if req.grammar is not None and not req.grammar.consume_token(token):
            log.error("request %s: token %d rejected by its grammar (%s)", req.request_id, token,
                      req.grammar.get_error())
            return self._finish(state, "stop")
        may_stop = req.num_output_tokens >= p.min_tokens
        if may_stop and not p.ignore_eos and token in req.eos_token_ids:
            return self._finish(state, "stop")
        if may_stop and token in p.stop_token_ids:
            return self._finish(state, "stop", stop_reason=token)
        before = len(state.detok.text)
        state.detok.add(token)
        state.text = state.detok.text
        if may_stop and p.stop_strings:
            hit = _find_stop(state.detok.text, p.stop_strings, before)
            if hit is not None:
                idx, stop = hit
                state.text = state.detok.text[:idx + (len(stop) if p.include_stop_str_in_output else 0)]
                return self._finish(state, "stop", stop_reason=stop)
        if req.grammar is not None and req.grammar.is_stopped():  # the grammar is complete: nothing may follow
            return self._finish(state, "stop")
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return self._finish(state, "length")

    def _finish(self, state: SequenceState, reason: str, stop_reason: int | str | None = None) -> None:
        req = state.req
        if req.is_finished:
            return
        if reason not in ("abort", "error") and not isinstance(stop_reason, str):  # not cut at a stop string
            state.detok.flush()
            state.text = state.detok.text
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        if reason == "abort":
            self.stats.aborted += 1
        elif reason != "error":  # failures are counted by _fail
            self.stats.finished[reason] += 1
            now = time.monotonic()
            self.stats.e2e.observe(now - req.arrival_time)
            if req.first_token_time is not None:
                self.stats.decode.observe(now - req.first_token_time)
        self.scheduler.remove(req)
        self.runner.sampler.forget(req.request_id)

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        outs = []
        for i, state in enumerate(group.seqs):
            req = state.req
            text = state.text
            stops = req.sampling_params.stop_strings
            if stops and not req.is_finished:  # hold back what may be the start of a stop string
                text = text[:max(0, len(text) - (max(map(len, stops)) - 1))]
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=list(req.output_token_ids), finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                logprobs=None if req.sampling_params.logprobs is None else list(req.output_logprobs)))
        first = group.seqs[0].req  # the one sequence of a group that computes prompt logprobs
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, outs, group.finished,
                             num_cached_tokens=max(0, first.num_cached_tokens),
                             prompt_logprobs=list(first.prompt_logprobs)
                             if first.sampling_params.prompt_logprobs is not None else None,
                             error=group.error)


def logprob_entry(token: int, chosen: float, top: list[tuple[int, float]]) -> dict[int, Logprob]:
    """vLLM's shape: the top alternatives by rank (from 1), and the token itself (unranked when
    it is not among them)."""
    entry = {tid: Logprob(lp, rank=r + 1) for r, (tid, lp) in enumerate(top)}
    entry.setdefault(token, Logprob(chosen))
    return entry


def _find_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the newly added text (so it may span token boundaries)."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, new_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def _fields(params: SamplingParams) -> dict:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
