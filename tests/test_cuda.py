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


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3", "mistral_swa", "qwen3_moe", "qwen2_moe", "qwen3_5",
                                  "qwen3_5_moe", "qwen3_next"])
def test_cuda_float32_logits_match_transformers(arch, hf_models, cache_dir):
    model, path = hf_models[arch]
    engine = LLMEngine(engine_settings(path, cache_dir, device="cuda"), show_progress=False)
    assert engine.runner.kv_caches[0][0].is_cuda
    logits, tokens = run_logits(engine, PROMPT, 16, chunks=[7, 33])
    ref = hf_logits(model, PROMPT + tokens[:-1])
    tol = 1e-3 * ref.abs().max().item()  # TF32 and other reductions orders on the GPU
    assert (logits.cpu() - ref).abs().max().item() <= tol
    assert tokens == hf_greedy(model, PROMPT, 17)


def generate_together(engine: LLMEngine, prompts: list[list[int]], params, prefix: str) -> list[list[int]]:
    """Tokens of each prompt, all submitted at once."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]


def test_cuda_batched_generation_matches_single(hf_models, cache_dir):
    from anna import SamplingParams

    _, path = hf_models["qwen2"]
    engine = LLMEngine(engine_settings(path, cache_dir, device="cuda"), show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT[:n] for n in (5, 17, 33, 40)]
    alone = [generate_together(engine, [p], params, f"a{i}-")[0] for i, p in enumerate(prompts)]
    assert generate_together(engine, prompts, params, "b") == alone


def test_cuda_profile_run_measures_an_activation_peak(hf_models):
    from anna.runtime.memory import profile_activation_peak, profile_decode_peak

    _, path = hf_models["qwen2"]
    runner = LLMEngine(engine_settings(path, path.parent, device="cuda"), show_progress=False).runner
    model, specs, platform = runner.model, runner.specs, runner.platform
    small = profile_activation_peak(model, specs, platform, 16, 1, 16)
    large = profile_activation_peak(model, specs, platform, 256, 64, 16)
    assert 0 < small < large
    # the decode graphs' workspace: one decode step, growing with the batch and the context
    decode = [profile_decode_peak(model, specs, platform, rows, context, 16)
              for rows, context in ((1, 16), (8, 16), (8, 512))]
    assert 0 < decode[0] < decode[1] < decode[2]


def test_cuda_graph_decode_matches_eager(hf_models, cache_dir):
    """--decode-executor graph captures CUDA graphs and decodes what eager decodes."""
    from anna import SamplingParams

    _, path = hf_models["qwen2"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [PROMPT[:n] for n in (5, 17, 33)]  # batch 3 pads to 4; 1-4 blocks pad to powers of two
    results = {}
    for executor in ("eager", "graph"):
        engine = LLMEngine(engine_settings(path, cache_dir, device="cuda", decode_executor=executor, max_num_seqs=8),
                           show_progress=False)
        assert engine.decode_executor == executor
        results[executor] = generate_together(engine, prompts, params, "r")
        if executor == "graph":
            graphs = engine.runner.decode_executor
            assert graphs is not None and graphs.capture  # no fallback to eager
            assert graphs.graphs and graphs.replays >= params.max_tokens - 1
        logits, _ = run_logits(engine, PROMPT, 8)
        results[executor + "_logits"] = logits
    assert results["graph"] == results["eager"]
    ref = results["eager_logits"]
    assert (results["graph_logits"] - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5"])
@pytest.mark.parametrize("executor", ["eager", "graph"])
def test_cuda_speculative_outputs_equal_plain_decoding(arch, executor, hf_models, cache_dir):
    """Prompt lookup and proposals wrong at every position, on the GPU (graphs where they run)."""
    from test_speculative import NGRAM, drain, greedy, looping_prompts, make_engine, use_oracle

    path = hf_models[arch][1]
    requests = [(f"r{i}", p, greedy(32)) for i, p in enumerate(looping_prompts())]
    kw = dict(device="cuda", decode_executor=executor)
    reference = {rid: o.outputs[0].token_ids for rid, o in drain(make_engine(path, cache_dir, **kw), requests).items()}
    for oracle in (False, True):
        engine = make_engine(path, cache_dir, NGRAM, **kw)
        if oracle:
            use_oracle(engine, reference, requests)
        assert {rid: o.outputs[0].token_ids for rid, o in drain(engine, requests).items()} == reference
    assert engine.stats.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("name, bound", [("float32", 0.002), ("int8", 0.03), ("fp8_e4m3", 0.12),
                                         ("turboquant4", 0.3), ("turboquant3", 0.55)])
def test_cuda_kv_cache_dtypes_stay_near_the_model_dtype_kv(name, bound, hf_models, cache_dir):
    """torch's reference formats on the GPU (what CPU kernels' bytes are checked against): logits
    with each KV cache dtype within its bound of the run with KV in the activation dtype."""
    _, path = hf_models["qwen2"]
    base = LLMEngine(engine_settings(path, cache_dir, device="cuda"), show_progress=False)
    ref, tokens = run_logits(base, PROMPT, 16)
    engine = LLMEngine(engine_settings(path, cache_dir, device="cuda", kv_cache_dtype=name), show_progress=False)
    assert engine.runner.kv_caches[0].format.name == name
    logits, _ = run_logits(engine, PROMPT, 16, chunks=[7, 33], forced=tokens)
    assert (logits - ref).norm() <= bound * ref.norm()
