"""The hybrid Qwen family (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) beyond the short-prompt parity of
test_model_parity.py: prompts longer than one gated-delta chunk (64) and several KV blocks, batches
that mix prefills and decodes, preemption, prefix reuse through state snapshots, n > 1, quantized
weights, the vision-language checkpoint layout and the config rules."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from anna import LLM, SamplingParams
from anna.model.config import ModelLoadError, load_model_config
from anna.runtime.engine import LLMEngine
from conftest import COMMON, HYBRID, engine_settings, save_hf_model, skip_without_cpu_kernels
from helpers import assert_logits_close, fake_quantized, hf_greedy, hf_logits, run_logits

HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
LONG = [(i * 37 + 11) % 700 + 3 for i in range(150)]  # > 2 chunks of 64, > 9 blocks of 16
PROMPTS = [LONG[:5], LONG[3:43], LONG[7:97], LONG[1:131]]


def make_llm(path, cache_dir, **kw) -> LLM:
    kw = {"max_model_len": 512, "num_gpu_blocks_override": 64, **kw}
    return LLM(str(path), dtype="float32", device="cpu", cache_dir=str(cache_dir), **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("chunks", [[150], [70, 80], [1, 63, 2, 84]], ids=["one_pass", "two_chunks", "odd_chunks"])
def test_long_prompt_logits_at_every_position_and_32_greedy_steps(arch, chunks, hf_models, cache_dir):
    """Prefill in one pass or in chunks that cut gated-delta chunks and KV blocks anywhere (the
    conv and recurrent states carry over), then 32 decode steps: logits at every position and the
    greedy tokens are transformers'."""
    model, path = hf_models[arch]
    engine = LLMEngine(engine_settings(path, cache_dir), show_progress=False)
    logits, tokens = run_logits(engine, LONG, 32, chunks=chunks)
    assert tokens == hf_greedy(model, LONG, 33)
    assert_logits_close(logits, hf_logits(model, LONG + tokens[:-1]))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.runner.caches.state.num_free == engine.runner.caches.state.num_slots


@pytest.mark.parametrize("arch", HYBRIDS)
def test_batched_sequences_of_different_lengths_with_chunked_prefill(arch, hf_models, cache_dir):
    """Four prompts (5 to 130 tokens) in steps of at most 64 tokens: prefills continue beside
    other sequences' decodes; each sequence's tokens are what transformers gives it alone."""
    model, path = hf_models[arch]
    llm = make_llm(path, cache_dir, max_num_batched_tokens=64)
    steps = []
    execute = llm.llm_engine.runner.execute
    llm.llm_engine.runner.execute = lambda batch: steps.append(list(batch.num_new_tokens)) or execute(batch)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 12) for p in PROMPTS]
    assert any(1 in s and any(n > 1 for n in s) for s in steps)  # a step mixed decodes and prefill chunks
    engine = llm.llm_engine
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.runner.caches.state.num_free == engine.runner.caches.state.num_slots


def test_preempted_sequences_recompute_their_state(hf_models, cache_dir):
    """A pool of 14 blocks cannot hold four growing sequences: the newest are preempted, freed
    (KV and state slot) and recomputed from the start, with unchanged tokens."""
    model, path = hf_models["qwen3_next"]
    llm = make_llm(path, cache_dir, num_gpu_blocks_override=14, max_model_len=200, max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 12) for p in PROMPTS]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.runner.caches.state.num_free == engine.runner.caches.state.num_slots


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_prefix_hits_restore_saved_states_and_change_no_token(arch, hf_models, cache_dir):
    """A second turn (the first prompt, its answer and a new message) and a prompt sharing 70
    tokens start from the states saved at the first prompt's block boundaries: the cached token
    counts say so, and every token equals the run without prefix caching (and transformers')."""
    model, path = hf_models[arch]
    cached = make_llm(path, cache_dir, max_num_batched_tokens=64)
    first = cached.generate({"prompt_token_ids": LONG[:100]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    turn2 = LONG[:100] + first.outputs[0].token_ids + [5, 6, 7, 8, 9] * 4
    prompts = [turn2, LONG[:70] + [1, 2, 3]]
    outs = cached.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    # the first prompt saved its state at 64 (a chunk's end) and 96 (its last block boundary)
    assert [o.num_cached_tokens for o in outs] == [96, 64]
    uncached = make_llm(path, cache_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    reference = uncached.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in reference] == [0, 0]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    assert outs[0].outputs[0].token_ids == hf_greedy(model, turn2, 12)
    engine = cached.llm_engine
    assert engine.kv.prefix_cache_hits == 96 + 64
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_exact_prompt_cache_default_and_no_prefix_hits_without_snapshots(hf_models, cache_dir, caplog):
    """With state snapshots (the default) paged prefix sharing serves the model, so the exact
    prompt cache is off by default and says why; without them it stays off too (its entries hold
    no recurrent state), and a repeated prompt is computed again."""
    _, path = hf_models["qwen3_5"]
    with caplog.at_level(logging.INFO, logger="anna.runtime.builder"):
        make_llm(path, cache_dir)
    assert any("Exact prompt cache: size=0" in r.message and "paged prefix blocks serve" in r.message
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="anna.runtime.builder"):
        llm = make_llm(path, cache_dir, state_snapshots=0)
    assert any("Exact prompt cache: size=0" in r.message and "no per-sequence state" in r.message
               for r in caplog.records)
    llm.generate({"prompt_token_ids": LONG[:100]}, GREEDY, use_tqdm=False)
    again = llm.generate({"prompt_token_ids": LONG[:100]}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and llm.llm_engine.kv.prefix_cache_hits == 0


def test_n_samples_start_from_the_first_samples_prompt_state(hf_models, cache_dir):
    """n = 3, seeded: the second and third samples wait for the first's prompt prefill and start
    from its state snapshot (80 of 90 prompt tokens each); the samples equal those of a run
    that computes every prompt in full."""
    _, path = hf_models["qwen3_5"]
    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=8, ignore_eos=True)
    shared = make_llm(path, cache_dir, max_num_batched_tokens=64)
    out = shared.generate({"prompt_token_ids": LONG[:90]}, params, use_tqdm=False)[0]
    assert shared.llm_engine.kv.prefix_cache_hits == 2 * 80
    alone = make_llm(path, cache_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    ref = alone.generate({"prompt_token_ids": LONG[:90]}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_quantized_weights_match_fake_quantized_transformers(arch, quant, hf_models, cache_dir, tmp_path):
    """Every linear layer and expert quantized (routers, the shared-expert gate and Gated
    DeltaNet's b/a stay exact). With torch's kernels Anna's logits are those of transformers
    running the same weights quantized and dequantized. Anna's packed kernels also round
    activations to int8 per 32 values; these tiny hybrid models amplify any rounding (int8
    weights alone move their logits 5-30%, against 2% for the tiny Qwen2), so the bound is
    relative: the kernels' extra error stays below the weights' own rounding error."""
    model, path = hf_models[arch]
    errors = {}
    for kernels in (False, True):
        engine = LLMEngine(engine_settings(path, cache_dir, quantization=quant, cpu_kernels=kernels,
                                           int4_cache_dir=str(tmp_path)), show_progress=False)
        assert type(engine.runner.model.layers[0].linear_attn.in_proj).__name__ == "QuantLinear"
        assert type(engine.runner.model.layers[0].linear_attn.in_proj_ba).__name__ == "Linear"
        logits, tokens = run_logits(engine, LONG[:80], 6)
        seq = LONG[:80] + tokens[:-1]
        fake = hf_logits(fake_quantized(model, quant), seq)
        errors[kernels] = ((logits - fake).norm() / fake.norm()).item()
    ref = hf_logits(model, seq)
    weights_error = ((fake - ref).norm() / ref.norm()).item()
    assert errors[False] < 1e-5
    if arch != "qwen3_5_moe" or quant == "int4":  # (int8 MoE: a flipped routing decides the greedy path)
        assert errors[True] < weights_error, (errors, weights_error)
    assert weights_error > 1e-3  # the weights really are quantized


@pytest.mark.parametrize("wrapper", ["Qwen3_5", "Qwen3_5Moe"])
def test_vision_language_checkpoint_serves_its_text_model(wrapper, tmp_path, cache_dir, caplog):
    """The Hub layout of Qwen3.5: config under text_config, weights under model.language_model.,
    a vision tower beside it. The text model loads (the tower is skipped with one log line) and
    gives the wrapper's own logits for a text prompt."""
    import transformers

    text = dict(COMMON, **HYBRID, tie_word_embeddings=False)
    if wrapper == "Qwen3_5Moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = getattr(transformers, f"{wrapper}Config")(text_config=text, vision_config=vision)
    torch.manual_seed(1)
    model = getattr(transformers, f"{wrapper}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    path = save_hf_model(model, tmp_path / "vl")
    assert json.loads((path / "config.json").read_text()).get("text_config")
    with caplog.at_level(logging.INFO, logger="anna.weights.loader"):
        engine = LLMEngine(engine_settings(path, cache_dir), show_progress=False)
    assert [r.message for r in caplog.records if "model.visual." in r.message and "images are not served" in r.message]
    logits, tokens = run_logits(engine, LONG[:70], 8)
    assert_logits_close(logits, hf_logits(model, LONG[:70] + tokens[:-1]))


def test_layer_types_default_and_bad_values(hf_models, tmp_path):
    src = hf_models["qwen3_5"][1]

    def with_config(**changes):
        dst = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (dst / "config.json").write_text(json.dumps(cfg))
        return dst

    cfg = load_model_config(with_config(layer_types=None))  # every fourth layer is full attention
    assert cfg.linear_attention.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.rotary_dim == 8 and cfg.rope_dim == 8  # partial_rotary_factor 0.25 of head_dim 32
    cfg = load_model_config(with_config(layer_types=None, full_attention_interval=2))
    assert cfg.linear_attention.layer_types == ("linear_attention", "full_attention") * 2
    with pytest.raises(ModelLoadError, match="layer_types"):
        load_model_config(with_config(layer_types=["linear_attention", "mamba", "full_attention", "full_attention"]))
    with pytest.raises(ModelLoadError, match="multiple of linear_num_key_heads"):
        load_model_config(with_config(linear_num_value_heads=3))
    with pytest.raises(ModelLoadError, match="linear_conv_kernel_dim"):
        load_model_config(with_config(linear_conv_kernel_dim=None))


def test_memory_plan_counts_kv_of_full_attention_layers_and_state_per_sequence(hf_models, cache_dir):
    _, path = hf_models["qwen3_5"]
    engine = LLMEngine(engine_settings(path, cache_dir, max_num_seqs=8, state_snapshots=5), show_progress=False)
    plan = engine.cache_plan
    assert plan.bytes_per_token == 2 * 2 * 32 * 4  # one full-attention layer: K and V, 2 heads of 32, fp32
    conv = 3 * (2 * 2 * 16 + 4 * 16) * 4  # kernel - 1 steps of q, k, v channels
    recurrent = 4 * 16 * 16 * 4
    assert plan.bytes_per_sequence == 3 * (conv + recurrent)  # three Gated DeltaNet layers
    assert plan.num_state_slots == 8 and plan.num_state_snapshots == 5
    recurrent_tensor = engine.runner.layer_caches[0]["recurrent"]
    assert recurrent_tensor.shape == (13, 4, 16, 16) and recurrent_tensor.dtype == torch.float32
    text = plan.describe(512)
    assert "state snapshots for prefix reuse: 5" in text and "max concurrency at max_model_len=512" in text


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_fused_cpu_decode_stack_matches_layer_by_layer(quant, hf_models, cache_dir):
    """Dense Qwen3.5 decodes through the fused C stack (csrc/decode_hybrid.c) by default: four
    sequences decoding together (their state slots and KV blocks scattered) give the tokens of the
    layer-by-layer path, and the fused stack really ran."""
    skip_without_cpu_kernels()
    model, path = hf_models["qwen3_5"]
    outputs = {}
    for executor in ("auto", "eager"):
        llm = make_llm(path, cache_dir, decode_executor=executor, quantization=quant, max_num_batched_tokens=64)
        runner = llm.llm_engine.runner
        fused = runner.decode_executor
        assert (type(fused).__name__ == "HybridFusedDecodeExecutor") == (executor == "auto")
        calls = []
        if fused is not None:
            run = fused.run
            fused.run = lambda *args: calls.append(1) or run(*args)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        outputs[executor] = [o.outputs[0].token_ids for o in outs]
        assert (len(calls) >= 8) == (executor == "auto")
    assert outputs["auto"] == outputs["eager"]
    if quant == "none":
        assert outputs["auto"] == [hf_greedy(model, p, 12) for p in PROMPTS]


def test_moe_hybrid_decodes_eager_and_says_why_when_graph_is_asked(hf_models, cache_dir, caplog):
    model, path = hf_models["qwen3_5_moe"]
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(engine_settings(path, cache_dir, decode_executor="graph"), show_progress=False)
    assert engine.runner.decode_executor is None
    assert any("mixture-of-experts" in r.message for r in caplog.records)
    _, tokens = run_logits(engine, LONG[:20], 4)
    assert tokens == hf_greedy(model, LONG[:20], 5)


def test_automatic_snapshots_take_at_most_a_quarter_of_the_budget(hf_models, cache_dir):
    """With a budget in GiB, the automatic snapshot count is capped at 25% of it; an explicit one
    is kept as given."""
    _, path = hf_models["qwen3_5"]
    budget = 2**20
    auto = LLMEngine(engine_settings(path, cache_dir, num_gpu_blocks_override=0, kv_cache_memory=budget / 2**30,
                                     max_num_seqs=24, state_snapshots=-1), show_progress=False).cache_plan
    per_seq = auto.bytes_per_sequence
    assert auto.num_state_snapshots == int(0.25 * budget // per_seq) < 24  # below the default (max_num_seqs)
    assert auto.num_blocks == (budget - (24 + auto.num_state_snapshots) * per_seq) // (16 * auto.bytes_per_token)
    explicit = LLMEngine(engine_settings(path, cache_dir, num_gpu_blocks_override=0, kv_cache_memory=budget / 2**30,
                                         max_num_seqs=24, state_snapshots=20), show_progress=False).cache_plan
    assert explicit.num_state_snapshots == 20
