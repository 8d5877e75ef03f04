"""The library entry point, shaped like vLLM's ``LLM`` so that vLLM code runs unchanged."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from tqdm import tqdm

from anna.core.config import ALIASES, IGNORED_VLLM_ARGS, RENAMED_VLLM_ARGS, ServeSettings
from anna.core.outputs import RequestOutput
from anna.beam_search import BeamSearchOutput, beam_search
from anna.core.sampling_params import BeamSearchParams, SamplingParams
from anna.runtime.engine import LLMEngine
from anna.weights.chat_template import render_chat

log = logging.getLogger(__name__)


Prompt = str | list[int] | dict[str, Any]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts: must be a string, token ids, a dict with 'prompt' or 'prompt_token_ids', "
                         f"or a list of those (got {type(prompts).__name__})")
    return list(prompts)


def _unwrap(prompt: Prompt) -> str | list[int]:
    """A TextPrompt / TokensPrompt dict's text or token ids; other prompts as they are."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("prompts: a dict prompt needs 'prompt' or 'prompt_token_ids'")


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        names = {f.name for f in dataclasses.fields(ServeSettings)}
        values: dict[str, Any] = {"model": model}
        for key, value in kwargs.items():
            key = RENAMED_VLLM_ARGS.get(key, ALIASES.get(key, key))
            if key in IGNORED_VLLM_ARGS:
                log.info("LLM(%s=...) has no effect in Anna", key)
            elif key in names:
                values[key] = value
            else:
                raise ValueError(f"{key}: not a setting of Anna's LLM")
        self.llm_engine = LLMEngine(ServeSettings(**values).resolve(explicit_source="argument"))
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel model (also done when the process exits)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (Anna's own where it
        has none, or with generation_config="none"); generate() uses these when given none."""
        return self.llm_engine.default_sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = []
        engine = self.llm_engine
        try:
            for prompt, p in zip(prompts, params):
                prompt = _unwrap(prompt)
                rid = f"llm-{self._counter}"
                self._counter += 1
                if isinstance(p, SamplingParams) and p.output_kind != "final_only":  # generate() returns finals only
                    p = dataclasses.replace(p, output_kind="final_only")
                engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        if not all(isinstance(conv, list) and conv and all(isinstance(m, dict) for m in conv)
                   for conv in conversations):
            raise ValueError("messages: must be a list of message dicts ({'role': ..., 'content': ...}), "
                             "or a list of such lists")
        tok = self.llm_engine.tokenizer
        prompts, texts = [], []
        for conv in conversations:
            text = render_chat(chat_template or tok.chat_template, conv, add_generation_prompt=add_generation_prompt,
                               tools=tools, special_tokens={"bos_token": tok.bos_token, "eos_token": tok.eos_token},
                               template_kwargs=chat_template_kwargs)
            texts.append(text)
            prompts.append(tok.encode(text, add_special_tokens=False))
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text  # the rendered conversation, as vLLM reports it
        return outputs

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of each prompt by beam search (vLLM's
        LLM.beam_search; see beam_search.py for how)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: must be a BeamSearchParams (got {type(params).__name__})")
        ids = [self.llm_engine.inputs.encode_prompt(_unwrap(p))[1] for p in _as_prompt_list(prompts)]
        return beam_search(self, ids, params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        finally:
            bar.close()
            for rid in pending:
                engine.abort_request(rid)
        for i, rid in enumerate(ids):  # after the others have finished: they are not cut short
            error = done[rid].error
            if error is not None:
                where = f" (prompt {i})" if len(ids) > 1 else ""
                raise error.as_exception(where)
        return [done[rid] for rid in ids]
