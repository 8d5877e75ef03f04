"""Who runs in the next step, and how many tokens each request gets.

Every step has a token budget (``max_num_batched_tokens``) and a sequence limit
(``max_num_seqs``). Running requests go first (a decode is one token; a request still
prefilling gets its next chunk), then waiting requests are admitted with prefill chunks.
When the KV pool runs out, the newest running request is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from anna.core.request import Request, RequestStatus
from anna.runtime.kv_cache import KVCacheManager
from anna.runtime.prompt_cache import PromptCache, PromptCacheEntry


class StepClass(enum.Enum):
    PURE_DECODE = "pure"
    PREFILL_INSERT = "+prefill_insert"  # decodes plus a newly admitted request's prefill
    BUDGET_RECOMPUTE = "+budget_recompute"  # decodes plus a continuing prefill chunk or a recompute
    PREFILL_ONLY = "prefill_only"


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int  # chunk size for a prefill that runs beside decodes
    prefill_interval_steps: int
    event_driven_prefill_insert: bool


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    restores: list[tuple[Request, PromptCacheEntry]] = field(default_factory=list)  # exact prompt cache hits
    step_class: StepClass = StepClass.PURE_DECODE

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, prompt_cache: PromptCache | None = None) -> None:
        self.config = config
        self.kv = kv
        self.prompt_cache = prompt_cache or PromptCache(0, 0)
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
        self.kv.free(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
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
        for req in list(self.running):
            if req.status is RequestStatus.PREEMPTED:  # preempted while making room for an earlier request
                continue
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n > 1 and len(self.running) > 1:
                n = min(n, cfg.long_prefill_token_threshold)
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                continue
            continuing_prefill |= n > 1
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n

        num_decoding = len(batch.requests)
        admitted = False
        if not batch.preempted and self._may_admit():
            while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
                req = self.waiting[0]
                first_admission = req.num_cached_tokens < 0
                computed, num_cached, restore = [], 0, None
                if req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None:
                    # (prompt logprobs need every prompt position computed, so no cache hits)
                    if self.prompt_cache.covers(req.prompt_token_ids):
                        req.register_prefix_blocks = False  # no double residency
                        restore = self.prompt_cache.lookup(req.prompt_token_ids, count=first_admission)
                        num_cached = req.num_prompt_tokens - 1 if restore else 0
                    else:
                        computed, num_cached = self.kv.get_computed_blocks(req)
                n = min(req.num_tokens - num_cached, budget)
                if num_decoding:
                    n = min(n, cfg.long_prefill_token_threshold)
                req.num_computed_tokens = num_cached if restore else 0
                if not self.kv.allocate_slots(req, n, computed):
                    req.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                if restore is not None:
                    batch.restores.append((req, restore))
                if first_admission:  # count the prefix lookup once per request
                    req.num_cached_tokens = num_cached
                    self.kv.record_prefix_lookup(req, num_cached)
                    req.first_scheduled_time = time.monotonic()
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
                admitted = True
        self.steps_since_admission = 0 if admitted else self.steps_since_admission + 1
        if num_decoding == 0:
            batch.step_class = StepClass.PREFILL_ONLY
        elif admitted:
            batch.step_class = StepClass.PREFILL_INSERT
        elif continuing_prefill or batch.preempted:
            batch.step_class = StepClass.BUDGET_RECOMPUTE
        return batch
