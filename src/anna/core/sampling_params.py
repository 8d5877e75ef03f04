"""Per-request sampling and stopping parameters, named and defaulted as vLLM names them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

OUTPUT_KINDS = ("cumulative", "final_only")
GREEDY_EPSILON = 1e-5  # temperatures below this mean greedy decoding
MAX_LOGPROBS = 20


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language: exactly one of these fields is set (vLLM's names).

    ``json``: a JSON schema (dict or JSON text); ``json_object``: any JSON object; ``regex``: a
    regular expression the whole output matches; ``choice``: one of these strings; ``grammar``: a
    Lark or GBNF grammar.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs: set exactly one of json, json_object, regex, choice, grammar "
                             f"(got {', '.join(given) or 'none'})")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON ({exc})") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json: a JSON schema must be an object")
        if isinstance(self.json, dict) and not isinstance(self.json.get("x-guidance", {}), dict):
            raise ValueError("structured_outputs.json: 'x-guidance' must be an object of grammar options")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex: must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar: must be a string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")

    def key(self) -> tuple[str, str]:
        """A hashable identity, so that equal constraints share one compiled grammar."""
        if self.json is not None:
            return "json", json.dumps(self.json, sort_keys=True)
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        if self.regex is not None:
            return "regex", self.regex
        return "grammar", self.grammar or ""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Logprob of every prompt token after the first, given the tokens before it, with this many
    # top alternatives (vLLM's prompt_logprobs; what echo + logprobs returns over HTTP)
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last that many tokens (vLLM's)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only among these (vLLM's)
    bad_words: list[str] | None = None  # words never generated, with or without a leading space (vLLM's)
    structured_outputs: StructuredOutputsParams | None = None
    # cumulative: an output after every step (streaming); final_only: one output when finished,
    # which lets the engine read sampled tokens back from the device every few steps only
    output_kind: str = "cumulative"
    # False: this request never speculates, where the engine has speculative decoding on (its
    # output is the same either way; this only saves the verification work)
    speculative: bool = True
    detokenize: bool = True  # False: token ids only, no text (vLLM's)
    # vLLM's names that Anna takes as they are where they mean what Anna does, and refuses otherwise
    spaces_between_special_tokens: bool = True
    best_of: int | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name of structured_outputs
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias: must map token ids to numbers (got {self.logit_bias!r})") from None
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("guided_decoding: give structured_outputs or its older name guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not is_num(getattr(self, name)) or not math.isfinite(getattr(self, name)):
                bad(name, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be -1, 0 (all tokens) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            bad("seed", "must be a 64-bit integer")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if self.truncate_prompt_tokens is not None and (not is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < 1):
            bad("truncate_prompt_tokens", "must be an integer >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, (list, tuple))
                                                   or not self.allowed_token_ids
                                                   or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative integers")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad("bad_words", "must be a list of non-empty strings")
        if self.logit_bias and any(not is_int(t) or t < 0 for t in self.logit_bias):
            bad("logit_bias", "keys must be non-negative token ids")
        if self.logit_bias and any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            bad("logit_bias", "values must be in [-100, 100]")
        if not isinstance(self.speculative, bool):
            bad("speculative", "must be true or false")
        if not isinstance(self.detokenize, bool):
            bad("detokenize", "must be true or false")
        if not self.detokenize and self.stop_strings:
            bad("detokenize", "must be true with stop strings, which are found in the text")
        if self.spaces_between_special_tokens is not True:
            bad("spaces_between_special_tokens", "Anna's tokenizer decodes special tokens as the tokenizer file "
                "says; only true is supported")
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", f"Anna returns every sample it draws, so best_of may only be n ({self.n})")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"must be one of {', '.join(OUTPUT_KINDS)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step reads 2 x beam_width candidates per beam


@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters, as vLLM names them. ``length_penalty``: the final ranking
    divides a sequence's cumulative logprob by its length (prompt included, as vLLM counts it) to
    this power."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width: must be an integer in [1, {MAX_BEAM_WIDTH}] (got {self.beam_width!r})")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1 (got {self.max_tokens!r})")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature: must be a number in [0, 100] (got {self.temperature!r})")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"length_penalty: must be a number (got {self.length_penalty!r})")
