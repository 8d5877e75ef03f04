"""Logprobs in the shapes clients read: the chat API's, the completions API's (with the prompt's
when echoed) and vLLM's prompt_logprobs field."""

from __future__ import annotations

from typing import Any

from anna.core.outputs import CompletionOutput, Logprob, RequestOutput
from anna.runtime.engine import LLMEngine


def token_text(engine: LLMEngine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(out: CompletionOutput, start: int, end: int, top: int) -> dict[str, Any] | None:
    """``top``: the alternatives asked for (each entry also holds the chosen token, ranked, where it
    is not among them)."""
    if out.logprobs is None:
        return None
    content = []
    for token, entry in zip(out.token_ids[start:end], out.logprobs[start:end]):
        text = entry[token].decoded_token
        content.append({"token": text, "logprob": entry[token].logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                          "bytes": list(lp.decoded_token.encode())}
                                         for lp in entry.values() if lp.rank <= top]})
    return {"content": content}


def completion_logprobs(engine: LLMEngine, out: CompletionOutput, start: int, end: int,
                        text_offset: int, top: int) -> dict[str, Any] | None:
    if out.logprobs is None:
        return None
    return legacy_logprobs(engine, out.token_ids[start:end], out.logprobs[start:end], text_offset, top)


def legacy_logprobs(engine: LLMEngine, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                    text_offset: int, top: int) -> dict[str, Any]:
    """The completions API's logprobs object, ``top`` alternatives each; a None entry (the first
    prompt token) has none."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = token_text(engine, token) if entry is None else entry[token].decoded_token
        tokens.append(text)
        token_lps.append(None if entry is None else entry[token].logprob)
        tops.append(None if entry is None else
                    {lp.decoded_token: lp.logprob for lp in entry.values() if lp.rank <= top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echoed_logprobs(engine: LLMEngine, out: RequestOutput, generated: dict[str, Any] | None,
                    top: int) -> dict[str, Any] | None:
    """echo + logprobs: the prompt's tokens and logprobs (``top`` alternatives), then the generated ones."""
    if generated is None or out.prompt_logprobs is None:
        return generated
    prompt = legacy_logprobs(engine, out.prompt_token_ids, out.prompt_logprobs, 0, top)
    return {key: prompt[key] + generated[key] for key in prompt}


def vllm_prompt_logprobs(out: RequestOutput) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs field: per prompt token, {token id: {logprob, rank, decoded_token}}."""
    return [None if entry is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()} for entry in out.prompt_logprobs or []]
