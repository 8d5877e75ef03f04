"""The speculative decoding setting, as vLLM spells it: one JSON object.

``{"method": "ngram" | "draft_model" | "mtp", "num_speculative_tokens": K, ...}``; a ``model``
without a method means a draft model, as in vLLM. The setting is kept as canonical JSON with
every default filled in, so that the start-up settings table shows what was resolved.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
# vLLM's other names of the multi-token-prediction method for the models Anna serves
METHOD_ALIASES = {"qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp", "draft": "draft_model"}
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's: with neither bound given, match 5-grams


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram: shortest suffix looked up in the context
    prompt_lookup_max: int | None = None  # ngram: longest
    model: str | None = None  # draft_model: the draft checkpoint's directory
    # Speculation is off in a step that runs more than this many sequences (0 = never off): a large
    # batch is compute-bound, so verifying extra tokens there is no longer nearly free
    disable_by_batch_size: int = 0
    # A sequence whose recent acceptance rate falls below this stops proposing for a while (0 = never)
    min_acceptance_rate: float = 0.2

    @property
    def uses_model(self) -> bool:
        """Whether proposals come from weights run by the runner (they need lookahead KV slots)."""
        return self.method in ("draft_model", "mtp")

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, sort_keys=True)


def parse_speculative_config(raw: Any) -> str:
    """Check a speculative_config value (JSON text or a dict) and return it as canonical JSON with
    the defaults filled in; "" (off) for an empty value. Raises ValueError naming the field."""
    if raw is None or raw == "" or raw == {}:
        return ""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config: must be a JSON object (got {type(raw).__name__})")
    return speculative_config_of(raw).to_json()


def speculative_config_of(raw: dict[str, Any]) -> SpeculativeConfig:
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
             "disable_by_batch_size", "min_acceptance_rate"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]}: not a key Anna knows (known: {', '.join(sorted(known))})")
    method = raw.get("method") or ("draft_model" if raw.get("model") else None)
    method = METHOD_ALIASES.get(method, method)
    if method not in METHODS:
        raise ValueError(f"speculative_config.method: must be one of {', '.join(METHODS)} (got {raw.get('method')!r})")

    def integer(name: str, low: int, high: int | None = None, default: int | None = None) -> int | None:
        value = raw.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"speculative_config.{name}: must be an integer {bound} (got {value!r})")
        return value

    k = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise ValueError("speculative_config.num_speculative_tokens: required (the tokens proposed per step)")
    lo, hi = integer("prompt_lookup_min", 1, 64), integer("prompt_lookup_max", 1, 64)
    if method == "ngram":
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo, hi = lo or hi, hi or lo
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min: must not exceed prompt_lookup_max={hi} (got {lo})")
    elif lo is not None or hi is not None:
        raise ValueError(f"speculative_config.prompt_lookup_{'min' if lo is not None else 'max'}: only for the "
                         "ngram method")
    model = raw.get("model")
    if method == "draft_model" and (not isinstance(model, str) or not model):
        raise ValueError("speculative_config.model: the draft model's directory is required for draft_model")
    if method != "draft_model" and model is not None:
        raise ValueError(f"speculative_config.model: only for the draft_model method (method is {method})")
    rate = raw.get("min_acceptance_rate", 0.2)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise ValueError(f"speculative_config.min_acceptance_rate: must be a number in [0, 1] (got {rate!r})")
    return SpeculativeConfig(method, k, lo, hi, model, integer("disable_by_batch_size", 0, default=0), float(rate))


def load_speculative_config(text: str) -> SpeculativeConfig | None:
    """The resolved setting's config, or None when speculation is off."""
    return speculative_config_of(json.loads(text)) if text else None
