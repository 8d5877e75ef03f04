"""Who runs in the next step, and how many tokens each request gets.

Every step has a token budget (``max_num_batched_tokens``) and a sequence limit
(``max_num_seqs``). Running requests go first (a decode is one token; a request still
prefilling gets its next chunk), then waiting requests are admitted with prefill chunks.
When the KV pool runs out, the newest running request is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue.

The scheduler also owns the requests' bookkeeping after a step (``update``): it counts what was
computed, appends sampled tokens, runs the stop checks that token ids decide (EOS, stop token
ids, a grammar, max_tokens, max_model_len), and frees what finished. Stop strings need text:
the output processor checks them and finishes the request here (``finish``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import logging

from anna.core.request import PENDING_TOKEN, Request, RequestStatus
from anna.runtime.cache_managers import CacheManagers, PrefixHit, StateCopy
from anna.runtime.metrics import EngineStats, StepClass
from anna.runtime.prompt_cache import PromptCache, PromptCacheEntry

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int  # chunk size for a prefill that runs beside decodes
    prefill_interval_steps: int
    event_driven_prefill_insert: bool
    # Speculative decoding: KV slots a model proposer writes beyond a step's tokens (0 for n-gram
    # proposals, which need none), and the batch size above which no step speculates (0 = none)
    num_lookahead_tokens: int = 0
    speculation_max_batch: int = 0


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    restores: list[tuple[Request, PromptCacheEntry]] = field(default_factory=list)  # exact prompt cache hits
    state_restores: list[StateCopy] = field(default_factory=list)  # before the step: prefix hits' states
    state_saves: list[tuple[Request, StateCopy]] = field(default_factory=list)  # after it: states to snapshot
    # per request: the proposed tokens this step verifies after its last token (counted in
    # num_new_tokens), and whether the proposer may write KV beyond the step's tokens (lookahead)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    may_propose: list[bool] = field(default_factory=list)
    step_class: StepClass = StepClass.PURE_DECODE

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


@dataclass
class TokenEvent:
    """What a step gave one request: its new tokens (several when proposed tokens were accepted),
    none (a prefill chunk), or (sync window) a token still on the device."""

    req: Request
    tokens: list[int]  # empty: none, or left on the device (see Request.pending)
    logprobs: list[tuple | None] = field(default_factory=list)  # one per token, None where not asked for


@dataclass(frozen=True)
class Stop:
    reason: str  # stop | length
    stop_reason: int | None = None  # the stop token id that ended it
    by_token: bool = False  # the token itself ended it (EOS, a stop token id): its text is not output


def stop_after(req: Request, token: int, max_model_len: int) -> Stop | None:
    """Whether the request ends with this token, just appended (and consumed by its grammar):
    the stop checks that token ids decide."""
    p = req.sampling_params
    may_stop = req.num_output_tokens >= p.min_tokens
    if may_stop and not p.ignore_eos and token in req.eos_token_ids:
        return Stop("stop", by_token=True)
    if may_stop and token in p.stop_token_ids:
        return Stop("stop", token, by_token=True)
    if req.grammar is not None and req.grammar.is_stopped():  # the grammar is complete: nothing may follow
        return Stop("stop")
    if req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
        return Stop("length")
    return None


class Scheduler:
    def __init__(self, config: SchedulerConfig, caches: CacheManagers, prompt_cache: PromptCache | None = None,
                 stats: EngineStats | None = None, max_model_len: int = 1 << 62) -> None:
        self.config = config
        self.caches = caches  # the cache managers the scheduler allocates through (one per kind)
        self.prompt_cache = prompt_cache or PromptCache(0, 0)
        self.stats = stats or EngineStats()
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.steps_since_admission = 0
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and return its blocks (finish or abort)."""
        for queue in (self.running, self.waiting):  # (Request compares by identity: one scan each)
            try:
                queue.remove(req)
                break
            except ValueError:
                pass
        self.caches.free(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.caches.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _may_admit(self) -> bool:
        if not self.running:
            return True
        return self.config.event_driven_prefill_insert or \
            self.steps_since_admission >= self.config.prefill_interval_steps

    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        batch = ScheduledBatch()
        budget = cfg.max_num_batched_tokens
        continuing_prefill = False
        speculating = not cfg.speculation_max_batch or len(self.running) + len(self.waiting) <= cfg.speculation_max_batch
        for req in list(self.running):
            if req.status is RequestStatus.PREEMPTED:  # preempted while making room for an earlier request
                continue
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n > 1 and len(self.running) > 1:
                n = min(n, cfg.long_prefill_token_threshold)
            n = self.caches.snapshot_boundary(req, req.num_computed_tokens, n) - req.num_computed_tokens
            spec, lookahead, may_propose = self._speculation(req, n, budget, speculating)
            while not self.caches.allocate_slots(req, n + len(spec), num_lookahead_tokens=lookahead):
                if may_propose:  # under memory pressure speculation goes before anyone is preempted
                    spec, lookahead, may_propose = [], 0, False
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                continue
            continuing_prefill |= n > 1
            self._plan_save(batch, req, req.num_computed_tokens, n)
            self._add(batch, req, n, spec, may_propose)
            budget -= n + len(spec)

        num_decoding = len(batch.requests)
        admitted = False
        if not batch.preempted and self._may_admit():
            deferred: list[Request] = []
            while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
                req = self.waiting[0]
                if self.caches.waits_for_leader(req):
                    deferred.append(self.waiting.popleft())
                    continue
                first_admission = req.num_cached_tokens < 0
                hit, num_cached, restore = PrefixHit(), 0, None
                if req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None:
                    # (prompt logprobs need every prompt position computed, so no cache hits)
                    if self.prompt_cache.covers(req.prompt_token_ids):
                        req.register_prefix_blocks = False  # no double residency
                        restore = self.prompt_cache.lookup(req.prompt_token_ids, count=first_admission)
                        num_cached = req.num_prompt_tokens - 1 if restore else 0
                    else:
                        hit = self.caches.get_computed_blocks(req)
                        num_cached = hit.num_tokens
                n = min(req.num_tokens - num_cached, budget)
                if num_decoding:
                    n = min(n, cfg.long_prefill_token_threshold)
                n = self.caches.snapshot_boundary(req, num_cached, n) - num_cached
                req.num_computed_tokens = num_cached if restore else 0
                _, lookahead, may_propose = self._speculation(req, n, budget, speculating)
                if not self.caches.allocate_slots(req, n, hit.blocks, lookahead):
                    may_propose = False
                    if not lookahead or not self.caches.allocate_slots(req, n, hit.blocks):
                        req.num_computed_tokens = 0
                        break
                self.waiting.popleft()
                if restore is not None:
                    batch.restores.append((req, restore))
                state_restore = self.caches.restore(req, hit)
                if state_restore is not None:
                    batch.state_restores.append(state_restore)
                self._plan_save(batch, req, num_cached, n)
                if first_admission:  # count the prefix lookup once per request
                    req.num_cached_tokens = num_cached
                    self.caches.record_prefix_lookup(req, num_cached)
                    req.first_scheduled_time = time.monotonic()
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._add(batch, req, n, [], may_propose)
                budget -= n
                admitted = True
            self.waiting.extendleft(reversed(deferred))
        self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1
        if num_decoding == 0:
            batch.step_class = StepClass.PREFILL_ONLY
        elif admitted:
            batch.step_class = StepClass.PREFILL_INSERT
        elif continuing_prefill or batch.preempted:
            batch.step_class = StepClass.BUDGET_RECOMPUTE
        return batch

    def _speculation(self, req: Request, n: int, budget: int, speculating: bool) -> tuple[list[int], int, bool]:
        """The proposed tokens this step verifies for the request (after its one decode token), the
        KV slots its proposer may write beyond the step, and whether it may propose after the
        step. Proposals count against the token budget like any tokens, and never run past
        max_tokens or max_model_len."""
        if not speculating or not req.sampling_params.speculative:
            return [], 0, False
        lookahead = self.config.num_lookahead_tokens
        spec = req.spec_token_ids
        if not spec or n != 1 or req.num_tokens - req.num_computed_tokens != 1 or req.pending:
            return [], lookahead, True
        room = min(budget - 1, req.sampling_params.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)
        return spec[:max(room, 0)], lookahead, True

    @staticmethod
    def _add(batch: ScheduledBatch, req: Request, n: int, spec: list[int], may_propose: bool) -> None:
        batch.requests.append(req)
        batch.num_new_tokens.append(n + len(spec))
        batch.spec_token_ids.append(spec)
        batch.may_propose.append(may_propose)

    def _plan_save(self, batch: ScheduledBatch, req: Request, start: int, n: int) -> None:
        save = self.caches.plan_save(req, start, n)
        if save is not None:
            batch.state_saves.append((req, save))

    # ---- bookkeeping after a step ----
    def step_failed(self, batch: ScheduledBatch) -> None:
        """The step raised: what it was to save was not written."""
        for _, save in batch.state_saves:
            self.caches.saved(save, False)

    def update(self, batch: ScheduledBatch, result) -> tuple[list[TokenEvent], list[Request]]:
        """Count what the step computed; return the requests' new tokens (in batch order) and the
        requests whose tokens left on the device are due to be read back. Requests the step
        failed (``result.failed``) and those finished meanwhile are left out (the engine fails them)."""
        for req, save in batch.state_saves:
            self.caches.saved(save, req.request_id not in result.failed)
        events: list[TokenEvent] = []
        due: list[Request] = []
        spec = batch.spec_token_ids or [[]] * len(batch.requests)
        for req, n, proposed in zip(batch.requests, batch.num_new_tokens, spec):
            if req.is_finished or req.request_id in result.failed:
                continue
            token = result.sampled.get(req.request_id)
            accepted = token.accepted if token is not None else []
            # the KV of rejected proposals is left behind the computed count: the next step overwrites it
            req.num_computed_tokens += n - len(proposed) + len(accepted)
            req.spec_token_ids = result.drafts.get(req.request_id, [])
            if proposed:
                self.stats.spec.record(len(proposed), len(accepted))
            if token is None:
                events.append(TokenEvent(req, []))  # a prefill chunk: no token yet
                continue
            if token.value is not None:
                events.append(TokenEvent(req, [*accepted, token.value], [*token.accepted_logprobs, token.logprobs]))
                continue
            req.append_output_token(PENDING_TOKEN)
            req.pending.append(token.ref)
            self.record_token(req)
            events.append(TokenEvent(req, []))
            if len(req.pending) >= req.sync_every or req.num_output_tokens >= req.sampling_params.max_tokens \
                    or req.num_tokens >= self.max_model_len:
                due.append(req)
        return events, due

    def take_pending(self, req: Request) -> int:
        """Drop the request's placeholders before its read-back tokens are appended; how many."""
        n = len(req.pending)
        req.pending.clear()
        del req.output_token_ids[-n:], req.all_token_ids[-n:]
        return n

    def record_token(self, req: Request) -> None:
        """Count a new output token and its timing, when it is sampled."""
        stats = self.stats
        stats.generation_tokens += 1
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
            stats.ttft.observe(now - req.arrival_time)
            if req.first_scheduled_time is not None:
                stats.queue.observe(req.first_scheduled_time - req.arrival_time)
                stats.prefill.observe(now - req.first_scheduled_time)
        else:
            stats.inter_token.observe(now - req.last_token_time)
        req.last_token_time = now

    def append_token(self, req: Request, token: int, record: bool = True) -> bool:
        """Append a sampled token and run the stop checks token ids decide; True when the token
        itself ended the request (EOS, a stop token id, rejected by the grammar: its text is not
        part of the output). A request that ends here is finished and freed."""
        req.append_output_token(token)
        if record:
            self.record_token(req)
        if req.grammar is not None and not req.grammar.consume_token(token):
            log.error("request %s: token %d rejected by its grammar (%s)", req.request_id, token,
                      req.grammar.get_error())
            self.finish(req, "stop")
            return True
        end = stop_after(req, token, self.max_model_len)
        if end is not None:
            self.finish(req, end.reason, end.stop_reason)
            return end.by_token
        return False

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (stop, length, abort, error): out of the queues, its caches freed. A
        request already finished keeps how it finished, but a stop string found in the text of
        its last token (the output processor's) ends it as a stop wherever else it stopped."""
        if req.is_finished:
            if isinstance(stop_reason, str) and req.finish_reason not in ("abort", "error"):
                self.stats.finished[req.finish_reason] -= 1
                self.stats.finished[reason] += 1
                req.finish_reason, req.stop_reason = reason, stop_reason
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        stats = self.stats
        if reason == "abort":
            stats.aborted += 1
        elif reason != "error":  # failures are counted by the engine, which knows their status
            stats.finished[reason] += 1
            now = time.monotonic()
            stats.e2e.observe(now - req.arrival_time)
            if req.first_token_time is not None:
                stats.decode.observe(now - req.first_token_time)
            stats.request_prompt_tokens.observe(req.num_prompt_tokens)
            stats.request_generation_tokens.observe(req.num_output_tokens)
        self.remove(req)
