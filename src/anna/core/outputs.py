"""What the engine hands back, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from anna.core.errors import RequestError


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: per prompt token, its logprob and the top alternatives
    # given the tokens before it (None for the first token, which has no context)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: RequestError | None = None  # set when the request failed (finished, finish_reason "error")
