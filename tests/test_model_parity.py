"""Anna's logits and greedy tokens against transformers, for every architecture and path."""

from __future__ import annotations

import pytest

from anna import LLM, SamplingParams
from anna.runtime.engine import LLMEngine
from conftest import ARCH_CONFIGS, engine_settings
from helpers import assert_logits_close, hf_greedy, hf_logits, run_logits

ARCHS = list(ARCH_CONFIGS)
PROMPT = [(i * 37 + 11) % 700 + 3 for i in range(40)]  # longer than two 16-token blocks
DECODE_STEPS = 32


@pytest.fixture(scope="module", params=[True, False], ids=["anna_kernels", "torch_kernels"])
def engines(request, hf_models, cache_dir):
    """Every test runs with Anna's CPU kernels and with torch's alone."""
    engines = {name: LLMEngine(engine_settings(path, cache_dir, cpu_kernels=request.param), show_progress=False)
               for name, (_, path) in hf_models.items()}
    assert all((e.runner.model.lm_head.ops.kernels is not None) == request.param for e in engines.values())
    return engines


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match(arch, hf_models, engines):
    model, _ = hf_models[arch]
    logits, tokens = run_logits(engines[arch], PROMPT, DECODE_STEPS)
    ref_tokens = hf_greedy(model, PROMPT, DECODE_STEPS + 1)
    assert tokens == ref_tokens
    ref = hf_logits(model, PROMPT + tokens[:-1])
    assert_logits_close(logits, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_single_pass(arch, hf_models, engines):
    model, _ = hf_models[arch]
    logits, tokens = run_logits(engines[arch], PROMPT, 4, chunks=[5, 16, 3, 16])
    ref = hf_logits(model, PROMPT + tokens[:-1])
    assert_logits_close(logits, ref)
    assert engines[arch].kv.num_free_blocks == engines[arch].kv.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_llm_generate_matches_transformers_greedy(arch, hf_models, cache_dir):
    model, path = hf_models[arch]
    llm = LLM(str(path), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
              num_gpu_blocks_override=64)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=DECODE_STEPS,
                                                                    ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(model, PROMPT, DECODE_STEPS)
    assert out[0].outputs[0].finish_reason == "length"
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.num_blocks


def test_never_written_cache_slots_do_not_leak(hf_models, cache_dir):
    """The KV pool is allocated uninitialized; padding slots may hold NaN and must never matter."""
    model, path = hf_models["qwen2"]
    engine = LLMEngine(engine_settings(path, cache_dir), show_progress=False)
    for k, v in engine.runner.kv_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    logits, tokens = run_logits(engine, PROMPT[:21], 5)
    assert_logits_close(logits, hf_logits(model, PROMPT[:21] + tokens[:-1]))


def test_the_rotary_tables_are_the_correctly_rounded_cos_and_sin_of_transformers_angles():
    """The cos and sin tables at every position are the fp32 angles' (inv_freq times the position,
    rounded to fp32 as transformers computes them) cos and sin to within rounding: torch's own fp32
    cos of angles in the hundreds of radians once came out 1.5e-4 off in some processes, which moved
    every logit past the first position beyond the transformers comparison's tolerance."""
    import torch

    from anna.model.layers import RotaryEmbedding, rope_inv_freq

    rotary = RotaryEmbedding(128, 4096, 1e6, None, torch.float32)
    angles = (torch.arange(4096, dtype=torch.float32)[:, None] * rope_inv_freq(128, 1e6, None)).double()
    assert (rotary.cos.double() - angles.cos()).abs().max() <= 2 ** -24  # half an ulp of values near 1
    assert (rotary.sin.double() - angles.sin()).abs().max() <= 2 ** -24
