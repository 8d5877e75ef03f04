"""Incremental detokenization never emits a broken UTF-8 character, and chat templates are sandboxed."""

from __future__ import annotations

import pytest

from anna.weights.chat_template import ChatTemplateError, render_chat
from anna.weights.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(qwen2_dir):
    return Tokenizer(qwen2_dir)


@pytest.mark.parametrize("text", ["Hello world", "日本語のテキストと韓國語 한국어", "emoji 😀🚀✨ mixed 中文 and café",
                                  "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ 🇫🇷 done"])
def test_incremental_detokenization_is_exact_and_never_broken(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 3
    detok = IncrementalDetokenizer(tok, tok.encode("prompt:", add_special_tokens=False))
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # byte-level tokens split multi-byte characters: some steps had to wait
    if any(ord(c) > 127 for c in text):
        assert "" in deltas


def test_special_tokens_skipped(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template_sandbox_blocks_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render_chat(evil, [{"role": "user", "content": "x"}])


def test_chat_template_raise_exception_is_an_error():
    tmpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render_chat(tmpl, [{"role": "system", "content": "x"}])
    assert render_chat(tmpl, [{"role": "user", "content": "x"}]) == "ok"


def test_chatml_fallback():
    out = render_chat(None, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_flush_emits_an_incomplete_character_at_the_end(tok):
    ids = tok.encode("ok 🦄🎉 fin", add_special_tokens=False)
    cut = next(ids[:n] for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))  # mid-character
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add(t) for t in cut)
    assert "\ufffd" not in streamed  # held back while more bytes might come
    detok.flush()
    assert detok.text == tok.decode(cut) and detok.text.endswith("\ufffd")


def test_final_text_equals_decoding_all_output_ids(qwen2_dir, cache_dir):
    from anna import LLM, SamplingParams

    llm = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), num_gpu_blocks_override=64,
              max_model_len=512)
    tok = llm.get_tokenizer()
    bytes_only = [t for t in range(400) if tok.decode([t]) == "\ufffd"][:1]  # a lone UTF-8 byte token
    assert bytes_only
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.5, seed=0, max_tokens=4, ignore_eos=True,
                                                   logit_bias={bytes_only[0]: 100}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == bytes_only * 4
    assert out.text == tok.decode(out.token_ids) != ""
