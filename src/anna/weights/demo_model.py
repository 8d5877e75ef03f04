"""The built-in demo model, and the demo tokenizer of the tests' random-weight models.

The demo model is a Qwen3 of 3.4 M parameters trained on synthetic tasks by
``benchmarks/train_tiny_model.py`` (``anna bench``'s passcode archives, copying a passage; copying
it with a word replaced and two-number sums were in its data but are not learned: asked for an
edit, it copies the passage unchanged). Its bf16 weights
ship in the package (``demo/``, with a 4-layer draft model in ``demo_draft/`` for draft-model
speculation) and are copied into the cache dir on first use after their checksum is checked, so a
fresh install runs end to end with no download, and answers those tasks.

``write_demo_tokenizer`` writes the smaller byte-level BPE that the tests' random-weight models
and ``benchmarks/make_random_model.py`` use."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from anna.model.config import ModelLoadError
from anna.weights.int4_cache import file_sha256

log = logging.getLogger(__name__)

DEMO_NAME = "anna-demo-qwen3-v3"
DEMO_DRAFT_NAME = "anna-demo-draft-qwen3-v3"
DEMO_NOTICE = ("the built-in demo model is tiny and trained only on synthetic tasks (retrieving a passcode from an "
               "archive of up to about 3K tokens, copying a passage): it knows nothing else")
DEMO_DRAFT_ALIAS = "anna-demo-draft"  # speculative_config {"model": "anna-demo-draft"} names the shipped draft
SHIPPED = Path(__file__).resolve().parent
# model.safetensors' SHA-256 of each shipped model, as train_tiny_model.py wrote it in the model's README.md
SHIPPED_SHA256 = {
    DEMO_NAME: ("demo", "00c42876bce7221385f869e6f2c258efbd070599ffa55404d22885481020ef96"),
    DEMO_DRAFT_NAME: ("demo_draft", "ace7e945623247562986a74ac7bb57616377e11dbae7b4d370ca9dfeefa70399"),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 1024
CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "Anna is an inference server for large language models. It serves models through an HTTP API that "
    "speaks the OpenAI protocol, and as a Python library. Requests are batched continuously: new prompts "
    "join running streams at every step, and long prompts are split into chunks.",
    "The key and value tensors of every token live in a paged cache of fixed-size blocks. Blocks that hold "
    "the same prefix are shared between requests, so a repeated system prompt is computed only once.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ! ? . , ; : ' \"",
    "大型语言模型的推理服务需要高效的批处理、分页的键值缓存以及前缀缓存。",
    "今天天气很好，我们一起去公园散步吧。机器学习和深度学习正在改变世界。",
    "Emoji and symbols: 😀 🚀 ✨ € £ ¥ — “quotes” and café, naïve, über.",
]


def train_bpe(texts: list[str], individual_digits: bool = False):
    """A byte-level BPE of VOCAB_SIZE tokens with the chat special tokens, trained on ``texts``
    (digits split one per token when asked: the trained demo model spells numbers that way)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if individual_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, target: Path, model_max_length: int) -> None:
    """tokenizer.json, and tokenizer_config.json with the ChatML template and its special tokens."""
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": model_max_length}, indent=2))


def write_demo_tokenizer(target: Path) -> tuple[int, int, int]:
    """Write tokenizer.json and tokenizer_config.json; return (vocab size, <|im_end|> id, <|endoftext|> id)."""
    tok = train_bpe(CORPUS * 4)
    save_tokenizer(tok, target, 4096)
    return tok.get_vocab_size(), tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")


def ensure_demo_model(cache_dir: str | Path, draft: bool = False) -> Path:
    """Path of the demo model (or its draft) in the cache dir, copied there atomically on first use."""
    name = DEMO_DRAFT_NAME if draft else DEMO_NAME
    cache_dir = Path(cache_dir).expanduser()
    target = cache_dir / name
    if (target / "model.safetensors").exists():
        return target
    folder, expected = SHIPPED_SHA256[name]
    source = SHIPPED / folder
    if file_sha256(source / "model.safetensors") != expected:
        raise ModelLoadError(f"{source / 'model.safetensors'}: checksum mismatch (the package's demo model is "
                             f"damaged; reinstall Anna)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=name + ".", dir=cache_dir))
    try:
        for file in source.iterdir():
            if file.is_file():
                shutil.copyfile(file, tmp / file.name)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("Copied the %s model into %s", "demo draft" if draft else "demo", target)
    return target
