"""Prompt shapes of LLM.generate, as vLLM names them: a dict with the text, or with token ids."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
