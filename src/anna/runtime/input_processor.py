"""From what a caller sends to what the engine runs: validated once, tokenized once.

The library (``LLMEngine.add_request``) and the HTTP server share this: the server runs
``process`` on its prompt thread pool (tokenizing and compiling a grammar off the event loop)
and hands the result to the engine client, which adds it without checking it again. Everything
a request can get wrong is refused here, before anything is allocated, with a ValueError that
starts with the field's name (a 400 over HTTP).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from anna.core.request import Request
from anna.core.sampling_params import SamplingParams
from anna.model.config import ModelConfig
from anna.runtime.output_processor import RequestGroup, SequenceState
from anna.runtime.structured_output import StructuredOutputCompiler
from anna.weights.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class ProcessedRequest:
    """A checked request, ready for the engine: its group and one Request per sequence."""

    group: RequestGroup
    num_prompt_tokens: int
    n: int


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, max_model_len: int,
                 eos_token_ids: frozenset[int], structured: StructuredOutputCompiler, token_sync_every: int,
                 sampling_defaults: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.structured = structured
        self.token_sync_every = token_sync_every
        self.sampling_defaults = sampling_defaults  # the model's generation_config, for fields a request leaves out

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
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
            text, ids = None, list(prompt)
        if truncate_prompt_tokens is not None and len(ids) > truncate_prompt_tokens:
            text, ids = None, ids[-truncate_prompt_tokens:]
        return text, ids

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Check what SamplingParams cannot check alone (lengths against max_model_len, token ids
        against the vocabulary); return the effective max_tokens. (The KV plan guarantees that the
        pool holds at least one max_model_len sequence, so a request that passes always fits.)"""
        vocab = self.vocab_size
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

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float | None = None) -> ProcessedRequest:
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        text, ids = self.encode_prompt(prompt, params.truncate_prompt_tokens)
        max_tokens = self.check_request(len(ids), params)
        spec = params.structured_outputs
        if spec is not None:
            self.structured.compile(spec)  # invalid constraints fail here, before anything is allocated
        bad_word_ids = self.bad_word_ids(params.bad_words or [])
        if params.allowed_token_ids and set(params.allowed_token_ids) <= {w[0] for w in bad_word_ids if len(w) == 1}:
            raise ValueError("allowed_token_ids: every allowed token is one of the bad_words, so no token could "
                             "ever be generated")
        group = RequestGroup(request_id, text, final_only=params.output_kind == "final_only")
        sync_every = self.sync_window(params)
        arrival = arrival_time or time.monotonic()
        for i in range(params.n):
            child = params
            if params.n > 1 or params.max_tokens != max_tokens:
                child = SamplingParams(**{**_fields(params), "n": 1, "max_tokens": max_tokens,
                                          "seed": None if params.seed is None else (params.seed + i) % 2**64,
                                          "prompt_logprobs": params.prompt_logprobs if i == 0 else None})
            req = Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, child, prompt=text,
                          eos_token_ids=self.eos_token_ids, arrival_time=arrival,
                          grammar=None if spec is None else self.structured.new_matcher(spec), sync_every=sync_every,
                          bad_word_ids=bad_word_ids)
            group.seqs.append(SequenceState(req, IncrementalDetokenizer(self.tokenizer, ids, child.skip_special_tokens)))
        return ProcessedRequest(group, len(ids), params.n)

    def sync_window(self, p: SamplingParams) -> int:
        """Steps between reading a request's tokens back: 1 unless nobody looks at them sooner
        (no stream, stop strings, logprobs, penalties, bad words or grammar, which need each token)."""
        if (p.output_kind != "final_only" or p.stop_strings or p.logprobs is not None
                or p.structured_outputs is not None or p.repetition_penalty != 1.0 or p.presence_penalty
                or p.frequency_penalty or p.bad_words):
            return 1
        return self.token_sync_every

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the tokens it is generated as: on its own and after a space (which
        most tokenizers fold into the word's first token), as vLLM reads bad_words."""
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out


def _fields(params: SamplingParams) -> dict:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
