"""The shipped demo model: its files are intact, Anna runs it as transformers does, and it does the
tasks it was trained on (a passcode at 1K tokens in ``anna bench``'s archive, copying a passage)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from anna import LLM, SamplingParams
from anna.bench.scenarios import archive_text, passcode_question
from anna.model.config import ModelLoadError
from anna.runtime.engine import LLMEngine
from anna.weights.demo_model import DEMO_DRAFT_NAME, DEMO_NAME, SHIPPED, SHIPPED_SHA256, ensure_demo_model
from anna.weights.int4_cache import file_sha256
from conftest import engine_settings, fresh_cache_dir
from helpers import assert_logits_close, hf_logits, run_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tiny_tasks  # noqa: E402


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory, cache_dir) -> Path:
    return fresh_cache_dir(tmp_path_factory.mktemp("demo") / "cache", cache_dir)


@pytest.fixture(scope="module")
def demo_llm(demo_cache) -> LLM:
    return LLM(cache_dir=str(demo_cache), device="cpu", max_model_len=2048)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("name", sorted(SHIPPED_SHA256))
def test_shipped_weights_match_their_checksum(name):
    folder, sha = SHIPPED_SHA256[name]
    assert file_sha256(SHIPPED / folder / "model.safetensors") == sha
    assert sha in (SHIPPED / folder / "README.md").read_text()  # the training run's own record
    config = json.loads((SHIPPED / folder / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["torch_dtype"] == "bfloat16"


def test_damaged_weights_are_refused(tmp_path, monkeypatch):
    folder, sha = SHIPPED_SHA256[DEMO_NAME]
    monkeypatch.setitem(SHIPPED_SHA256, DEMO_NAME, (folder, sha[::-1]))
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        ensure_demo_model(tmp_path)
    assert not (tmp_path / DEMO_NAME).exists()


def test_both_models_are_copied_once(demo_cache):
    for draft in (False, True):
        path = ensure_demo_model(demo_cache, draft=draft)
        assert path.name == (DEMO_DRAFT_NAME if draft else DEMO_NAME)
        assert file_sha256(path / "model.safetensors") == SHIPPED_SHA256[path.name][1]
        assert ensure_demo_model(demo_cache, draft=draft) == path


@pytest.mark.parametrize("draft", [False, True], ids=["demo", "draft"])
def test_logits_match_transformers(draft, demo_cache, cache_dir):
    from transformers import AutoModelForCausalLM

    path = ensure_demo_model(demo_cache, draft=draft)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = LLMEngine(engine_settings(path, cache_dir, dtype="float32"), show_progress=False)
    prompt = engine.tokenizer.encode(passcode_question(archive_text(3, 8, "123456")), add_special_tokens=False)
    logits, tokens = run_logits(engine, prompt, 8, chunks=[len(prompt) - 40, 40])
    assert_logits_close(logits, hf_logits(ref_model, prompt + tokens[:-1]))


def test_retrieves_the_bench_passcode_at_1k_tokens(demo_llm):
    """``anna bench``'s own passcode prompt (its archive, its question) at about 1,000 tokens, three seeds."""
    tok = demo_llm.get_tokenizer()
    prompts, codes = [], []
    for seed in range(3):
        code = f"{random.Random(seed).randrange(10**5, 10**6)}"
        text = passcode_question(archive_text(seed, 46, code))
        assert 900 <= len(tok.encode(text, add_special_tokens=False)) <= 1100
        prompts.append(user(text))
        codes.append(code)
    outs = demo_llm.chat(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for code, out in zip(codes, outs):
        assert out.outputs[0].text.strip() == code
        assert out.outputs[0].finish_reason == "stop"


def test_copies_a_passage(demo_llm):
    chat = tiny_tasks.copy(random.Random(7), 60)
    out = demo_llm.chat(user(chat.prompt), SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    assert out.outputs[0].text == chat.answer
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    {"model": "anna-demo-draft", "num_speculative_tokens": 4},  # the shipped draft, by its alias
], ids=["ngram", "draft_model"])
def test_speculation_accepts_most_of_a_copy(spec, demo_llm, demo_cache):
    """On a copy the proposals are mostly right (a random model's are not), and the output is the plain one."""
    chat = tiny_tasks.copy(random.Random(11), 60)
    params = SamplingParams(temperature=0, max_tokens=200)
    plain = demo_llm.chat(user(chat.prompt), params, use_tqdm=False)[0].outputs[0]
    llm = LLM(cache_dir=str(demo_cache), device="cpu", max_model_len=2048, speculative_config=json.dumps(spec))
    out = llm.chat(user(chat.prompt), params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.token_ids
    assert llm.llm_engine.stats.spec.acceptance_rate >= 0.5
