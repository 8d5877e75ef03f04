"""Tokenizer: Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, plus the
special tokens and chat template from ``tokenizer_config.json``, and incremental detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from anna.model.config import ModelLoadError

REPLACEMENT_CHAR = "\ufffd"
DETOKENIZE_CONTEXT = 6  # prompt tokens decoded with the first output tokens so that leading spaces survive


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise ModelLoadError(f"{tok_file}: file not found (Anna needs a fast tokenizer's tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise ModelLoadError(f"{tok_file}: cannot load tokenizer ({exc})") from None
        cfg_file = path / "tokenizer_config.json"
        self.config: dict[str, Any] = {}
        if cfg_file.exists():
            try:
                self.config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"{cfg_file}: not valid JSON ({exc})") from None
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        self.chat_template: str | None = template
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (grammar engines build their token trie from it)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not, for ~1 s per MB of text), so that the
        # server can tokenize a long prompt in a thread while other requests stream
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, never splitting a UTF-8 character.

    Each step decodes a short window of ids twice (with and without the new tokens) and emits
    the difference, unless it ends in a replacement character: then the token holds only part
    of a character and the text waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-DETOKENIZE_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the output: emit what was held back, even an incomplete character (as
        decoding all the ids at once would), and return the delta."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
