"""The built-in demo model: a tiny Qwen2-architecture model with seeded random weights and a real
byte-level BPE tokenizer, written on first use into the cache dir, so that a fresh install runs
end to end with no download. Its text is meaningless by construction."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

DEMO_NAME = "anna-demo-qwen2-v1"
DEMO_NOTICE = "the built-in demo model has random weights: its output text is meaningless"
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


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def write_demo_tokenizer(target: Path) -> tuple[int, int, int]:
    """Write tokenizer.json and tokenizer_config.json; return (vocab size, <|im_end|> id, <|endoftext|> id)."""
    tok = _build_tokenizer()
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": 4096}, indent=2))
    return tok.get_vocab_size(), tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")


def write_demo_model(target: Path, seed: int = 0) -> None:
    """Write the demo model files into ``target`` (an empty directory)."""
    vocab, eos, endoftext = write_demo_tokenizer(target)
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": endoftext, "eos_token_id": eos, "use_sliding_window": False,
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, endoftext]}))
    gen = torch.Generator().manual_seed(seed)
    h, inter, kv = 64, 128, 2 * 16

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.5 / shape[-1] ** 0.5

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(2):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.q_proj.bias": rand(h),
            p + "self_attn.k_proj.weight": rand(kv, h), p + "self_attn.k_proj.bias": rand(kv),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.v_proj.bias": rand(kv),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })
    save_file(tensors, str(target / "model.safetensors"))
    (target / "README.md").write_text(f"{DEMO_NAME}: {DEMO_NOTICE}.\n")


def ensure_demo_model(cache_dir: str | Path) -> Path:
    """Path of the demo model, creating it atomically on first use."""
    cache_dir = Path(cache_dir).expanduser()
    target = cache_dir / DEMO_NAME
    if (target / "model.safetensors").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=DEMO_NAME + ".", dir=cache_dir))
    try:
        write_demo_model(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("Created the demo model in %s", target)
    return target
