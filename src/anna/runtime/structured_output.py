"""Constrained decoding: grammars compiled by llguidance, applied as token masks in the sampler.

llguidance computes the set of allowed next tokens from the grammar's parser state and the
tokenizer's token trie at each step (tens of microseconds), with no per-grammar precomputation
over the vocabulary, and its work per grammar and per step is bounded by fuel limits, so a hostile
schema costs a bounded time (or is refused) instead of stalling the engine. Compiled grammars are cached by their text; each
sequence gets its own copy of the matcher, which tracks where in the grammar the sequence is.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from anna.core.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

# JSON as models write it (and json.dumps does): ", " and ": ", no other whitespace. Flexible
# whitespace lets a weak model pad a document forever without ever finishing it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SHIFTS = torch.arange(32, dtype=torch.int32)
# llguidance's lexer fuel per grammar and per mask step, a fifth and a quarter of its defaults: a
# regex built to explode ("(a{1000}){1000}") then costs ~0.1 s once instead of ~1.3 s, while a
# realistic nested schema's slowest step on a 32k vocabulary drops from 2.0 to 0.4 ms.
LEXER_FUEL = {"initial_lexer_fuel": 200_000, "step_lexer_fuel": 50_000}


def json_schema_of(spec: StructuredOutputsParams) -> Any:
    """The JSON schema a json / json_object constraint stands for, with Anna's JSON layout options."""
    schema = {"type": "object"} if spec.json_object else spec.json
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return schema


class StructuredOutputCompiler:
    """Turns :class:`StructuredOutputsParams` into per-sequence grammar matchers."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], *,
                 cache_size: int, max_spec_bytes: int) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self.cache_size = cache_size
        self.max_spec_bytes = max_spec_bytes
        self._lltok: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # the HTTP side compiles ahead; the engine thread looks up

    def _tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance

            start = time.perf_counter()
            self._lltok = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                 eos_token=self._eos or None)
            log.info("Structured output: token trie built in %.0f ms", 1e3 * (time.perf_counter() - start))
        return self._lltok

    def grammar_text(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar for a constraint (not yet checked)."""
        import llguidance

        if spec.json is not None or spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(json_schema_of(spec))
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        try:
            return llguidance.grammar_from("grammar", spec.grammar or "")
        except ValueError as exc:
            raise ValueError(f"structured_outputs.grammar: {exc}") from None

    def compile(self, spec: StructuredOutputsParams, field: str = "structured_outputs") -> Any:
        """The compiled matcher template for ``spec`` (cached); ValueError naming ``field`` if invalid."""
        import llguidance

        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if len(key[1]) > self.max_spec_bytes:
            raise ValueError(f"{field}: the {key[0]} constraint is {len(key[1])} bytes, more than the "
                             f"{self.max_spec_bytes} this server accepts")
        grammar = self.grammar_text(spec)
        tok = self._tokenizer()
        limits = llguidance.LLParserLimits(**LEXER_FUEL, verbose_errors=False)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=limits)
        if is_error:
            raise ValueError(f"{field}: invalid {key[0]}: {messages[0]}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=limits)
        # The first mask builds the lexer's start states, the costly part of a pathological grammar:
        # do it here, in the caller's thread, rather than in the engine's first step.
        scratch = torch.empty((self.vocab_size + 31) // 32, dtype=torch.int32)  # must outlive the call
        matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
        if matcher.is_error():
            raise ValueError(f"{field}: invalid {key[0]}: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, spec: StructuredOutputsParams, field: str = "structured_outputs") -> Any:
        """A fresh matcher at the start of the grammar, for one sequence."""
        return self.compile(spec, field).deep_copy()


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Set to -inf, in place, the logits of tokens each row's grammar does not allow next."""
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for k, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), words * 32)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.long)
    allowed, index = allowed.to(logits.device, non_blocking=True), index.to(logits.device)  # (no-op on CPU)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

