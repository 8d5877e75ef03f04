"""The engine on a CUDA device against transformers (run where a GPU is present; CI has none).

    python -m pytest -m cuda
"""

from __future__ import annotations

import pytest
import torch

from anna.runtime.engine import LLMEngine
from conftest import engine_settings
from helpers import hf_greedy, hf_logits, run_logits

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT = [(i * 37 + 11) % 700 + 3 for i in range(40)]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3", "mistral_swa"])
def test_cuda_float32_logits_match_transformers(arch, hf_models, cache_dir):
    model, path = hf_models[arch]
    engine = LLMEngine(engine_settings(path, cache_dir, device="cuda"), show_progress=False)
    assert engine.runner.kv_caches[0][0].is_cuda
    logits, tokens = run_logits(engine, PROMPT, 16, chunks=[7, 33])
    ref = hf_logits(model, PROMPT + tokens[:-1])
    tol = 1e-3 * ref.abs().max().item()  # TF32 and other reductions orders on the GPU
    assert (logits.cpu() - ref).abs().max().item() <= tol
    assert tokens == hf_greedy(model, PROMPT, 17)


def test_cuda_batched_generation_matches_single(hf_models, cache_dir):
    from anna import SamplingParams

    _, path = hf_models["qwen2"]
    engine = LLMEngine(engine_settings(path, cache_dir, device="cuda"), show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT[:n] for n in (5, 17, 33, 40)]
    alone = []
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params)
        while engine.has_unfinished_requests():
            out = engine.step()
            if out and out[0].finished:
                alone.append(out[0].outputs[0].token_ids)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    together = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                together[out.request_id] = out.outputs[0].token_ids
    assert [together[f"b{i}"] for i in range(4)] == alone


def test_cuda_profile_run_measures_an_activation_peak(hf_models):
    from anna.model.config import load_model_config
    from anna.runtime.memory import profile_activation_peak

    _, path = hf_models["qwen2"]
    engine_model = LLMEngine(engine_settings(path, path.parent, device="cuda"), show_progress=False).runner.model
    cfg = load_model_config(str(path))
    small = profile_activation_peak(engine_model, cfg, 16, 1, 16, torch.device("cuda"), torch.float32)
    large = profile_activation_peak(engine_model, cfg, 256, 64, 16, torch.device("cuda"), torch.float32)
    assert 0 < small < large
