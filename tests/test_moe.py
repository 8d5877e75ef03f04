"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) beyond the single-sequence parity of
test_model_parity.py: batched and prefix-cached decoding, quantized experts, the executors, and
the config rules that decide which layers have experts."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from anna import LLM, SamplingParams
from anna.model.config import ModelLoadError, load_model_config
from anna.model.layers import GatedMLP
from anna.model.moe import SparseMoE
from anna.runtime.engine import LLMEngine
from conftest import engine_settings
from helpers import fake_quantized, hf_greedy, hf_logits, run_logits

PREFIX = [(i * 41 + 5) % 700 + 3 for i in range(34)]  # two full 16-token blocks and a bit
PROMPTS = [PREFIX + [7, 8, 9], PREFIX[:20] + [11], PREFIX + [12, 13, 14, 15, 16], [3, 4]]


def make_llm(path, cache_dir, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
               num_gpu_blocks_override=64, **kw)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_batched_and_prefix_cached_generation_matches_transformers(arch, hf_models, cache_dir):
    """Four prompts decoded in one batch (each step routes every sequence's token), two of them
    reusing cached prefix blocks, give transformers' greedy tokens for each prompt alone."""
    model, path = hf_models[arch]
    llm = make_llm(path, cache_dir)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.generate({"prompt_token_ids": PREFIX + [1]}, params, use_tqdm=False)  # fills the prefix cache
    hits = llm.llm_engine.kv.prefix_cache_hits
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.llm_engine.kv.prefix_cache_hits - hits >= 2 * 32 + 16
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 10) for p in PROMPTS]
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.num_blocks


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_experts_match_fake_quantized_transformers(quant, hf_models, cache_dir, tmp_path):
    """Every expert is quantized (the router is not): Anna's logits agree within 2% (relative norm)
    with transformers running the same weights quantized and dequantized."""
    model, path = hf_models["qwen2_moe"]
    engine = LLMEngine(engine_settings(path, cache_dir, quantization=quant, int4_cache_dir=str(tmp_path)),
                       show_progress=False)
    moe = engine.runner.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and type(moe.experts[0].gate_up_proj).__name__ == "QuantLinear"
    assert type(moe.gate).__name__ == "Linear" and type(moe.shared_expert_gate).__name__ == "Linear"
    logits, tokens = run_logits(engine, PREFIX, 6)
    seq = PREFIX + tokens[:-1]
    fake = hf_logits(fake_quantized(model, quant), seq)
    assert ((logits - fake).norm() / fake.norm()).item() < 0.02
    ref = hf_logits(model, seq)
    assert ((logits - ref).norm() / ref.norm()).item() > 1e-4  # the experts really are quantized


def test_int4_layout_cache_round_trips_experts(hf_models, cache_dir, tmp_path, caplog):
    path = tmp_path / "m"
    shutil.copytree(hf_models["qwen3_moe"][1], path)
    first = LLMEngine(engine_settings(path, cache_dir, quantization="int4"), show_progress=False)
    reference, _ = run_logits(first, PREFIX, 3)
    with caplog.at_level(logging.INFO, logger="anna.weights.loader"):
        second = LLMEngine(engine_settings(path, cache_dir, quantization="int4"), show_progress=False)
    assert any("Loaded the int4 layout from" in r.message for r in caplog.records)
    assert torch.equal(run_logits(second, PREFIX, 3)[0], reference)


def test_moe_decodes_eager_and_says_why_when_graph_is_asked(hf_models, cache_dir, caplog):
    """On CPU the graph executor is the fused C decode stack, which has no experts: auto picks
    eager, and an explicit graph runs eager with one warning that says why."""
    model, path = hf_models["qwen3_moe"]
    auto = LLMEngine(engine_settings(path, cache_dir), show_progress=False)
    assert auto.decode_executor == "eager" and auto.runner.decode_executor is None
    with caplog.at_level(logging.WARNING, logger="anna.runtime.compilation"):
        graph = LLMEngine(engine_settings(path, cache_dir, decode_executor="graph"), show_progress=False)
    assert graph.decode_executor == "eager"
    assert [r.message for r in caplog.records if "decode_executor=graph" in r.message] == [
        "decode_executor=graph: mixture-of-experts layers choose their experts on the host each step; running eager"]
    _, tokens = run_logits(graph, PREFIX, 8)
    assert tokens == hf_greedy(model, PREFIX, 9)


def test_compiled_forward_matches_eager(cache_dir, tmp_path):
    """torch.compile traces around the experts' host read-back (a graph break) and decodes the same
    tokens as eager. (One layer: compiling unrolls the layers, ~30 s each on a 2-core CPU.)"""
    from conftest import build_hf_model, save_hf_model

    model = build_hf_model("mixtral", num_hidden_layers=1)
    path = save_hf_model(model, tmp_path / "mixtral")
    llm = make_llm(path, cache_dir, compile_mode="default", cpu_kernels=False,
                   torchinductor_cache_dir=str(tmp_path / "inductor"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert llm.llm_engine.runner.model_forward.compiled is not None  # it ran compiled, not the fallback
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(model, p, 6) for p in PROMPTS[:2]]


def write_config(src, dst, **changes) -> None:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))


def test_which_layers_have_experts(cache_dir, tmp_path):
    """decoder_sparse_step and mlp_only_layers decide it, as in transformers: with 4 layers, step 2
    and layer 3 dense, only layer 1 has experts; the logits still match."""
    import transformers

    from conftest import COMMON, save_hf_model

    config = transformers.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 4}, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])
    torch.manual_seed(1)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # as conftest.build_hf_model: logits far from uniform
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    path = save_hf_model(model, tmp_path / "m")
    engine = LLMEngine(engine_settings(path, cache_dir), show_progress=False)
    assert engine.model_config.moe.sparse_layers == (False, True, False, False)
    assert [type(layer.mlp) for layer in engine.runner.model.layers] == [GatedMLP, SparseMoE, GatedMLP, GatedMLP]
    logits, tokens = run_logits(engine, PREFIX, 4)
    ref = hf_logits(model, PREFIX + tokens[:-1])
    assert (logits - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_hub_spelling_of_the_expert_count(hf_models, cache_dir, tmp_path):
    """Qwen's Hub checkpoints say num_experts (transformers 5 writes num_local_experts)."""
    model, src = hf_models["qwen3_moe"]
    write_config(src, tmp_path / "m", num_experts=8, num_local_experts=None)
    engine = LLMEngine(engine_settings(tmp_path / "m", cache_dir), show_progress=False)
    assert engine.model_config.moe.num_experts == 8
    assert run_logits(engine, PREFIX, 4)[1] == hf_greedy(model, PREFIX, 5)


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(num_local_experts=0), "0 experts"),
])
def test_bad_expert_counts_are_refused(changes, message, hf_models, tmp_path):
    write_config(hf_models["qwen3_moe"][1], tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model_config(tmp_path / "m")


def test_missing_expert_tensor_is_named_as_the_checkpoint_names_it(hf_models, cache_dir, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(hf_models["mixtral"][1], dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.block_sparse_moe\.experts\.5\.w3"):
        LLMEngine(engine_settings(dst, cache_dir), show_progress=False)
