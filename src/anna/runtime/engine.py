"""The engine loop: ``step()`` = schedule -> execute -> update -> outputs.

The parts are built once (runtime/builder.py); the loop only hands results from one to the
next: the scheduler plans a step and updates its bookkeeping from the runner's output, the
output processor turns tokens into text and RequestOutputs. Requests may be added and aborted
between any two steps. A request with ``n > 1`` runs as n sequences that share the prompt's KV
blocks through the prefix cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from anna.core.config import ResolvedSettings, ServeSettings
from anna.core.errors import EngineDeadError, RequestError
from anna.core.outputs import RequestOutput
from anna.core.request import Request
from anna.core.sampling_params import SamplingParams
from anna.runtime.builder import build_engine_parts
from anna.runtime.input_processor import ProcessedRequest
from anna.runtime.metrics import EngineStats
from anna.runtime.model_runner import StepResult
from anna.runtime.output_processor import OutputProcessor, RequestGroup, SequenceState, logprob_entry
from anna.runtime.scheduler import ScheduledBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """What metrics, logs, warmup and memory release read of a running engine, at one moment."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_cache_size: int
    prompt_cache_max_tokens: int
    prompt_cache_lookups: int
    prompt_cache_hits: int
    kv_resident_bytes: int
    memory_releases: int
    stats: EngineStats
    num_steps: int


class LLMEngine:
    def __init__(self, settings: ServeSettings | ResolvedSettings, *, show_progress: bool = True) -> None:
        parts = build_engine_parts(settings if isinstance(settings, ResolvedSettings) else settings.resolve(),
                                   show_progress)
        self.settings = parts.settings
        self.model_dir, self.is_demo = parts.model_dir, parts.is_demo
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.platform, self.device = parts.platform, parts.platform.device
        self.dtype, self.activation_dtype = parts.dtype, parts.activation_dtype
        self.max_model_len = parts.max_model_len
        self.profiler = parts.profiler
        self.decode_executor, self.compile_mode = parts.decode_executor, parts.compile_mode
        self.cache_plan = parts.plan
        self.kv, self.prompt_cache, self.scheduler, self.runner = parts.kv, parts.prompt_cache, parts.scheduler, \
            parts.runner
        self.memory = parts.memory
        self.inputs = parts.inputs
        self.outputs = OutputProcessor()
        self.workers = parts.workers

    def check_ranks(self) -> None:
        """Raise EngineDeadError if another rank of a tensor-parallel model has ended."""
        if self.workers is not None and self.workers.dead is not None:
            raise EngineDeadError(f"the engine cannot run any more: {self.workers.dead}")

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel model (nothing to do on one device)."""
        if self.workers is not None:
            self.workers.close()

    # ---- what the parts hold, for callers ----
    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.inputs.eos_token_ids

    @property
    def structured(self):
        return self.inputs.structured

    @property
    def token_sync_every(self) -> int:
        return self.inputs.token_sync_every

    @property
    def sampling_defaults(self) -> dict:
        return self.inputs.sampling_defaults

    @property
    def groups(self) -> dict[str, RequestGroup]:
        return self.outputs.groups

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.inputs.sampling_defaults)

    def snapshot(self) -> EngineSnapshot:
        kv, pc, sched = self.kv, self.prompt_cache, self.scheduler
        return EngineSnapshot(
            num_running=len(sched.running), num_waiting=len(sched.waiting), kv_usage=kv.usage,
            num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks, num_cached_blocks=kv.num_cached_blocks,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=sched.num_preemptions, prompt_cache_size=pc.size, prompt_cache_max_tokens=pc.max_tokens,
            prompt_cache_lookups=pc.lookups, prompt_cache_hits=pc.hits,
            kv_resident_bytes=self.memory.resident_bytes(), memory_releases=self.memory.releases, stats=self.stats,
            num_steps=sum(self.stats.steps.counts.values()))

    def reset_after_warmup(self) -> None:
        """Forget what warmup did: cached prefixes and prompts, counters and histograms."""
        self.scheduler.caches.reset_prefix_cache()
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = 0
        self.prompt_cache.clear()
        self.prompt_cache.lookups = self.prompt_cache.hits = 0
        self.scheduler.num_preemptions = 0
        self.reset_stats()

    def warm_up_decode_executor(self, batch_sizes: list[int]) -> int:
        """Let the decode executor prepare its shapes (CUDA graphs); returns how many it ran."""
        executor = self.runner.decode_executor
        return executor.warm_up(batch_sizes) if executor is not None else 0

    def release_idle_memory(self, periodic: bool) -> None:
        """From the idle loop: the memory releaser's check (see runtime/memory_release.py)."""
        self.memory.maybe_release(idle=True, periodic=periodic)

    def commit_idle_memory(self, seconds: float) -> bool:
        """From the idle loop: commit fresh KV memory ahead of use for up to ``seconds``; whether
        there is more to do (see runtime/memory_release.py)."""
        return self.memory.commit_ahead(seconds)

    def reset_stats(self) -> None:
        """Forget the counters and histograms (after warmup)."""
        self.scheduler.stats = EngineStats()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- requests ----
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.outputs.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.add_processed(self.inputs.process(request_id, prompt, params, arrival_time))

    def add_processed(self, processed: ProcessedRequest) -> None:
        """Add a request the input processor checked (the server's path: checked once, on its
        thread pool)."""
        group = processed.group
        if group.request_id in self.outputs.groups:
            raise ValueError(f"request_id: {group.request_id!r} is already in use")
        self.outputs.add(group)
        for state in group.seqs:
            if state is not group.seqs[0]:
                state.req.prefix_leader = group.seqs[0].req
            self.scheduler.add(state.req)
        self.stats.prompt_tokens += processed.num_prompt_tokens * processed.n

    def abort_request(self, request_id: str) -> None:
        group = self.outputs.groups.get(request_id)
        if group is None:
            return
        self.outputs.forget(group)
        for state in group.seqs:
            self._finish(state.req, "abort")

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run -> update -> outputs. A failure is confined to the requests
        it belongs to (they end with a RequestError); the engine raises only EngineDeadError, when
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
            self.scheduler.step_failed(batch)
            self._fail_unattributed(batch.requests, exc, touched)
            return self._outputs(touched)
        self.stats.steps.record(batch.step_class, time.perf_counter() - start)
        self.stats.iteration_tokens.observe(batch.total_tokens)
        if self.profiler is not None:
            self.profiler.step_finished(start)
        for req in batch.requests:
            error = result.failed.get(req.request_id)
            if error is not None and not req.is_finished:
                self._fail(req, error, touched)
        try:
            events, due = self.scheduler.update(batch, result)
        except Exception as exc:
            log.exception("updating the requests of a step failed")
            self._fail_unattributed(batch.requests, exc, touched)
            return self._outputs(touched)
        for event in events:
            req = event.req
            try:
                self._take_step_output(req, event.tokens, event.logprobs, result, touched)
            except Exception as exc:
                log.exception("request %s: processing its step output failed", req.request_id)
                self._fail(req, RequestError.internal(exc), touched)
        if due:
            try:
                self._sync_tokens(due, touched)
            except Exception as exc:  # reading back from the device failed: it may be gone
                log.exception("reading sampled tokens back failed")
                self._fail_unattributed(due, exc, touched)
        return self._outputs(touched)

    def _take_step_output(self, req: Request, tokens: list[int], logprobs: list[tuple | None], result: StepResult,
                          touched: dict[str, RequestGroup]) -> None:
        if req.request_id in result.prompt_logprobs:
            first, entries = result.prompt_logprobs[req.request_id]
            for pos, (chosen, top, rank) in enumerate(entries, first):
                req.prompt_logprobs[pos] = self._decoded(logprob_entry(req.prompt_token_ids[pos], chosen, top, rank))
        if req.request_id not in result.sampled:
            return
        first_token = req.num_output_tokens == (0 if tokens else 1)  # (a placeholder is appended)
        if first_token and self.prompt_cache.covers(req.prompt_token_ids) \
                and req.prompt_token_ids not in self.prompt_cache:  # the prompt's KV is complete now
            self.prompt_cache.insert(req.prompt_token_ids, self.runner.read_prompt_kv(req))
        group, state = self.outputs.seqs[req.request_id]
        for token, entry in zip(tokens, logprobs):  # in order, as if each came from a step of its own
            self._append_token(state, token, entry)
            if req.is_finished:  # accepted proposals after a stop are dropped
                break
        touched[group.request_id] = group

    def _append_token(self, state: SequenceState, token: int, logprobs: tuple | None, record: bool = True) -> None:
        req = state.req
        ended_by_token = self.scheduler.append_token(req, token, record)
        if logprobs is not None:  # shaped once per token, not on every output
            entry = self._decoded(logprob_entry(token, *logprobs))
            req.output_logprobs.append(entry)
            req.cumulative_logprob += entry[token].logprob
        hit = self.outputs.add_token(state, token, ended_by_token)
        if hit is not None:
            self._finish(req, "stop", stop_reason=hit[1])
        elif req.is_finished:
            self.runner.forget(req.request_id)

    def _decoded(self, entry: dict) -> dict:
        """A logprob entry with each token's text (vLLM's decoded_token), decoded once here for the
        library and the server alike."""
        for token_id, lp in entry.items():
            lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return entry

    def _sync_tokens(self, due: list[Request], touched: dict[str, RequestGroup]) -> None:
        """Read the pending tokens of these requests back in one copy, then check them in order as
        if each had arrived on its own step; tokens after a stop are discarded."""
        values = self.runner.read_back([ref for req in due for ref in req.pending])
        offset = 0
        for req in due:
            n = self.scheduler.take_pending(req)
            tokens, offset = values[offset:offset + n], offset + n
            group, state = self.outputs.seqs[req.request_id]
            for i, token in enumerate(tokens):
                self._append_token(state, token, None, record=False)
                if req.is_finished:
                    self.stats.generation_tokens -= n - i - 1  # computed past the stop, then dropped
                    break
            touched[group.request_id] = group

    def _outputs(self, touched: dict[str, RequestGroup]) -> list[RequestOutput]:
        outputs = []
        finished_any = False
        for group in touched.values():
            if group.final_only and not group.finished:
                continue
            try:
                outputs.append(self.outputs.make_output(group))
            except Exception as exc:
                log.exception("request %s: building its output failed", group.request_id)
                self._fail(group.seqs[0].req, RequestError.internal(exc), {})
                outputs.append(self.outputs.error_output(group))
            if group.finished:
                finished_any = True
                self.outputs.forget(group)
                if group.error is None and all(s.req.finish_reason in ("stop", "length") for s in group.seqs):
                    self.stats.request_max_generation_tokens.observe(max(s.req.num_output_tokens for s in group.seqs))
        if finished_any and not self.scheduler.has_work():
            self.memory.maybe_release(idle=True, periodic=False)
        return outputs

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        self.runner.forget(req.request_id)

    # ---- failures ----
    def _fail(self, req: Request, error: RequestError, touched: dict[str, RequestGroup]) -> None:
        """End the request this sequence belongs to, all its sequences, with ``error``."""
        entry = self.outputs.seqs.get(req.request_id)
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
            self._finish(state.req, "error")
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
        caches = self.scheduler.caches
        if not caches.allocate_slots(req, 1):
            return  # every block is in use by running requests: they show soon enough whether it works
        try:
            result = self.runner.execute(ScheduledBatch(requests=[req], num_new_tokens=[1]))
            if req.request_id not in result.sampled:
                raise RuntimeError(f"the probe got no token: {result.failed.get(req.request_id)}")
        finally:
            blocks = self.kv.block_ids(req.request_id)
            caches.free(req)
            self.kv.pool.uncache(blocks)
            self.runner.forget(req.request_id)
