"""Checkpoint layouts, both config forms, and clear errors for broken model directories."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from anna.model.config import ModelLoadError, load_model_config
from anna.runtime.engine import LLMEngine
from conftest import build_hf_model, engine_settings, fresh_cache_dir, save_hf_model
from helpers import assert_logits_close, hf_logits, run_logits

PROMPT = list(range(5, 45))


def test_sharded_checkpoint_loads(tmp_path, cache_dir):
    model = build_hf_model("qwen3", seed=3)
    path = save_hf_model(model, tmp_path / "sharded", max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    engine = LLMEngine(engine_settings(path, cache_dir, weight_load_pipeline_workers=3), show_progress=False)
    logits, _ = run_logits(engine, PROMPT, 2)
    assert_logits_close(logits[:len(PROMPT)], hf_logits(model, PROMPT))


def test_transformers4_config_form_loads_the_same(tmp_path, hf_models, cache_dir):
    model, src = hf_models["llama3"]
    dst = tmp_path / "v4"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    assert rope["rope_type"] == "llama3"
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = dict(rope, type=rope.pop("rope_type"))  # 4.x used "type"
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (dst / "config.json").write_text(json.dumps(cfg))
    parsed = load_model_config(dst)
    assert parsed.rope_theta == 500000.0 and parsed.rope_scaling["rope_type"] == "llama3"
    engine = LLMEngine(engine_settings(dst, cache_dir), show_progress=False)
    logits, _ = run_logits(engine, PROMPT, 1)
    assert_logits_close(logits[:len(PROMPT)], hf_logits(model, PROMPT))


@pytest.fixture
def broken(tmp_path, qwen2_dir):
    dst = tmp_path / "m"
    shutil.copytree(qwen2_dir, dst)
    return dst


def _load(path, cache_dir):
    return LLMEngine(engine_settings(path, cache_dir), show_progress=False)


def test_missing_directory(tmp_path, cache_dir):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        _load(tmp_path / "nope", cache_dir)


def test_missing_config(broken, cache_dir):
    (broken / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        _load(broken, cache_dir)


def test_unsupported_architecture(broken, cache_dir):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architectures.*GPT2LMHeadModel"):
        _load(broken, cache_dir)


def test_shape_mismatch_names_the_tensor(broken, cache_dir):
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight.*\[7, 64\]"):
        _load(broken, cache_dir)


def test_missing_tensor_is_named(broken, cache_dir):
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.0\.self_attn\.k_proj\.bias"):
        _load(broken, cache_dir)


def test_pickle_checkpoint_is_refused(broken, cache_dir):
    (broken / "model.safetensors").rename(broken / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*convert the checkpoint to safetensors"):
        _load(broken, cache_dir)


def test_corrupt_safetensors(broken, cache_dir):
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="cannot read safetensors file"):
        _load(broken, cache_dir)


def test_missing_tokenizer(broken, cache_dir):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file not found"):
        _load(broken, cache_dir)


def test_missing_shard_listed_in_index(tmp_path, cache_dir):
    path = save_hf_model(build_hf_model("qwen2"), tmp_path / "sh", max_shard_size="60KB")
    sorted(path.glob("model-*-of-*.safetensors"))[-1].unlink()
    with pytest.raises(ModelLoadError, match="shard listed in model.safetensors.index.json is missing"):
        _load(path, cache_dir)


def test_max_model_len_that_cannot_fit_is_refused_with_the_largest_that_fits(qwen2_dir, cache_dir):
    with pytest.raises(ValueError, match="largest max_model_len that fits is 64"):
        LLMEngine(engine_settings(qwen2_dir, cache_dir, num_gpu_blocks_override=4, max_model_len=100),
                  show_progress=False)


def test_demo_model_is_created_and_runs(tmp_path, cache_dir):
    from anna import LLM, SamplingParams

    fresh_cache_dir(tmp_path, cache_dir)
    llm = LLM(cache_dir=str(tmp_path), device="cpu")
    assert llm.llm_engine.is_demo
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    again = LLM(cache_dir=str(tmp_path), device="cpu")  # second start reuses the files
    out2 = again.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out2[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_memory_plan_logs_each_step(qwen2_dir, cache_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="anna.runtime.builder"):
        engine = LLMEngine(engine_settings(qwen2_dir, cache_dir, kv_cache_memory=0.001, num_gpu_blocks_override=0,
                                           log_level="info", max_model_len=256), show_progress=False)
    plan = next(r.message for r in caplog.records if r.message.startswith("Memory plan:"))
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()) / 2**20
    assert f"weights: {weights:.1f} MiB on cpu" in plan
    assert "profile run: skipped on cpu" in plan and "graphs/compile workspace: 0 MiB" in plan
    blocks = int(0.001 * 2**30) // (16 * 2 * 2 * 2 * 16 * 4)  # tokens x K,V x layers x kv heads x head_dim x fp32
    assert engine.kv.num_blocks == blocks
    per_token = 2 * 2 * 2 * 16 * 4
    assert f"paged attention KV: float32 rows, {per_token} bytes per token; {blocks} blocks x 16 tokens = {blocks * 16} tokens" in plan
    assert "per-sequence state" not in plan  # no layer of this model keeps one
    assert f"max concurrency at max_model_len=256: {blocks * 16 / 256:.2f}" in plan
