"""A request as the engine sees it: token ids and how many of them have been computed.

Chunked prefill, prefix-cache hits and preemption by recompute are all the same thing here:
``num_computed_tokens`` catching up with ``num_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from anna.core.sampling_params import SamplingParams


PENDING_TOKEN = -1  # an output token sampled on the device and not yet read back to the host


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: compared and hashed by identity, never field by field
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in a cache on first admission; -1 until admitted
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    register_prefix_blocks: bool = True  # False when the exact prompt cache is responsible for this prompt
    # n > 1: the first sample, whose prompt prefill the others may wait for and reuse (its KV
    # blocks and, for recurrent layers, its state snapshot); None for the first and for n = 1
    prefix_leader: Request | None = field(default=None, repr=False)
    # Per output token: {token id: Logprob} for the top alternatives and the chosen token
    output_logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # with logprobs: the sum of the output tokens' logprobs
    # With prompt_logprobs: per prompt position, {token id: Logprob} once computed (None for the
    # first); a recompute after preemption writes the same positions again
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    bad_word_ids: list[list[int]] = field(default_factory=list)  # token sequences of bad_words
    grammar: Any = None  # an llguidance matcher when the output is constrained; it tracks the output so far
    # Token sync window: sampled tokens are read back every sync_every steps; until then each is a
    # PENDING_TOKEN in the token lists and (device tensor, row) here, oldest first.
    sync_every: int = 1
    pending: list[tuple[Any, int]] = field(default_factory=list)
    # Speculative decoding: tokens proposed to follow the last one, verified by the next step (never
    # part of the token lists until accepted); set after each step by the proposer
    spec_token_ids: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
