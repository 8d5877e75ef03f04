"""KV caches stored as bf16/fp16, fp8, int8 and TurboQuant 4/3 bits (--kv-cache-dtype): each
format's round-trip error against its published or analytic bound, Anna's C kernels against the
torch reference (the same bytes, the same attention), end-to-end logits against an fp32 KV run,
and the cache machinery (chunked prefill, preemption, memory release, the exact prompt cache's
default; prefix hits: tests/test_scheduler.py) on quantized blocks."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anna import LLM, SamplingParams
from anna.core.config import ServeSettings
from anna.model.attention import PagedKV, build_metadata, torch_decode_attention
from anna.model.kv_format import KVFormat, lloyd_max_levels, rotation, turboquant_mse
from anna.platforms.cpu.kernels import LEVEL_CFLAGS
from anna.runtime.engine import LLMEngine
from conftest import engine_settings, kernels_at_level
from helpers import run_logits
from test_scheduler import assert_pool_free, drain, workload

QUANTIZED = ["fp8_e4m3", "int8", "turboquant4", "turboquant3"]
TYPES = ["bfloat16", "float16", *QUANTIZED]
# logits of the tiny models with each KV type against the same model with fp32 KV (decode steps fed
# the fp32 run's tokens): the norm of the difference relative to the logits' (the worst of the four
# architectures measured: bf16 0.013, fp16 0.0003, int8 0.015, fp8 0.061, turboquant4 0.16,
# turboquant3 0.36, the MoE model's routing being the most sensitive)
LOGIT_BOUND = {"bfloat16": 0.03, "float16": 0.003, "int8": 0.03, "fp8_e4m3": 0.12, "turboquant4": 0.3,
               "turboquant3": 0.55}
PROMPT = [(i * 37 + 11) % 700 + 3 for i in range(40)]


def unit_rows(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


def squared_error(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    return ((fmt.decode(fmt.encode(x)) - x) ** 2).sum(-1)


# ---- the formats ----

@pytest.mark.parametrize("name, bits, published", [("turboquant4", 4, 0.009), ("turboquant3", 3, 0.034)])
def test_turboquant_round_trip_error_is_the_published_one_for_any_vector(name, bits, published):
    """TurboQuant's squared error per unit vector at head dim 128 (0.009 at 4 bits, 0.034 at 3), for
    random vectors and for vectors whose energy sits in a few coordinates: after the rotation every
    vector looks alike. Without the rotation (or with a wrong codebook) the spiky rows fail."""
    fmt = KVFormat(name, 128)
    mse = squared_error(fmt, unit_rows(4096, 128)).mean().item()
    assert abs(mse - published) < 0.1 * published, mse
    assert abs(mse - turboquant_mse(128, bits)) < 0.05 * mse  # the codebook's own expected error
    spiky = torch.zeros(256, 128)
    spiky[torch.arange(256), torch.arange(256) % 128] = 1.0  # one-hot rows
    spiky[128:, 5] = 1.0  # two large coordinates
    spiky = spiky / spiky.norm(dim=-1, keepdim=True)
    assert abs(squared_error(fmt, spiky).mean().item() - published) < 0.25 * published
    big = unit_rows(512, 128, seed=1) * 300.0  # the norm is kept: the error scales with it
    assert abs(squared_error(fmt, big).mean().item() / 300.0 ** 2 - published) < 0.15 * published


@pytest.mark.parametrize("name", ["turboquant4", "turboquant3"])
def test_turboquant_rows_keep_their_length(name):
    """The stored scale makes a decoded row exactly as long as the row (to the fp16 scale's 2^-11):
    the bare levels shrink each row by its own few percent, which scales keys' scores unevenly."""
    fmt = KVFormat(name, 64)
    x = torch.randn(1000, 64, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 2, 1000).unsqueeze(1)
    kept = fmt.decode(fmt.encode(x)).norm(dim=-1) / x.norm(dim=-1)
    assert torch.allclose(kept, torch.ones(1000), atol=1e-3), kept.sub(1).abs().max()


def test_turboquant_rotation_and_levels():
    for dim in (64, 128):
        r = rotation(dim)
        assert torch.allclose(r @ r.T, torch.eye(dim), atol=1e-5)
        assert torch.equal(r, rotation(dim))  # seeded: the same matrix every time
        for bits in (3, 4):
            levels, bounds = lloyd_max_levels(dim, bits)
            assert levels.numel() == 2 ** bits and torch.all(levels[1:] > levels[:-1])
            assert torch.allclose(levels, -levels.flip(0), atol=1e-6)  # the law is symmetric
            assert torch.allclose(bounds, (levels[1:] + levels[:-1]) / 2)
    # the coordinates of a unit vector shrink as 1/sqrt(d): so do the levels
    assert math.isclose(lloyd_max_levels(128, 4)[0][-1] / lloyd_max_levels(64, 4)[0][-1], 2 ** -0.5, rel_tol=0.03)


def test_scaled_formats_error_bounds():
    """int8: at most half a step (max|x| / 254) per value; fp8 e4m3: half an ulp (2^-4 of the value,
    or 2^-10 of the scale among subnormals); bf16/fp16 exactly torch's conversion."""
    x = torch.randn(2000, 64) * torch.logspace(-3, 2, 2000).unsqueeze(1)
    amax = x.abs().amax(-1, keepdim=True)
    err = (KVFormat("int8", 64).decode(KVFormat("int8", 64).encode(x)) - x).abs()
    assert torch.all(err <= amax / 254 * 1.002 + 1e-12)
    fp8 = KVFormat("fp8_e4m3", 64)
    err = (fp8.decode(fp8.encode(x)) - x).abs()
    scale = amax / 448
    assert torch.all(err <= torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10) * 1.01 + 1e-12)
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert torch.equal(KVFormat(name, 64).decode(KVFormat(name, 64).encode(x)), x.to(dtype).float())
    for name in QUANTIZED:  # a zero row stays zero (no 0 / 0)
        assert torch.equal(KVFormat(name, 64).decode(KVFormat(name, 64).encode(torch.zeros(3, 64))),
                           torch.zeros(3, 64))


def test_bytes_per_row():
    assert [KVFormat(n, 128).row_bytes for n in ["float32", *TYPES]] == [512, 256, 256, 130, 130, 66, 50]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVFormat("turboquant4", 36)


# ---- Anna's C kernels against the reference ----

@pytest.fixture(scope="module", params=list(LEVEL_CFLAGS))
def kernels(request, cache_dir):
    return kernels_at_level(request.param, cache_dir)


@pytest.mark.parametrize("name", TYPES)
def test_kernel_writes_the_reference_bytes(kernels, name):
    fmt = KVFormat(name, 64)
    rows = torch.randn(50, 2, 64, generator=torch.Generator().manual_seed(3)) * 4
    cache = torch.zeros(10, 2, 16, fmt.row_width, dtype=fmt.storage_dtype)
    slots = torch.randperm(160, generator=torch.Generator().manual_seed(4))[:50]
    kernels.kv_write(fmt, rows, cache, slots)
    stored = cache[slots // 16, :, slots % 16]
    ref = fmt.encode(rows)
    if name.startswith("turboquant"):  # the rotation's sums run in another order: a value at a cell
        same = (stored == ref).float().mean().item()  # boundary may fall on the other side
        assert same > 0.99
        assert torch.allclose(fmt.decode(stored), fmt.decode(ref), atol=0.5)
        assert torch.allclose(fmt.decode(stored).norm(dim=-1), rows.norm(dim=-1), rtol=1e-3)
    else:
        assert torch.equal(stored.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dim,bs", [(64, 16), (128, 16), (64, 12)])
def test_kernel_attention_over_quantized_rows_equals_the_dequantized_reference(kernels, name, window, dim, bs):
    """The kernel reads stored rows directly (TurboQuant: against rotated queries, rotating its
    output back); the reference decodes them first and runs torch's attention. Where int8 and
    TurboQuant 4-bit keys score on VNNI's int8 dot products, each head's query is quantized to
    int8 (its largest value at 127) and TurboQuant's levels are int8 too: about 1% of the
    output's scale, against 1e-5 elsewhere. 600 positions span three of the kernel's 256-position
    tiles, whose sums are rescaled as the running maximum grows. Blocks of 16 rows hold a whole
    group of sixteen positions (read from one base, their scales gathered); blocks of 12, and the
    window's unaligned start, split groups across blocks."""
    torch.manual_seed(5)
    fmt, blocks = KVFormat(name, dim), 64
    cache = PagedKV(fmt.encode(torch.randn(blocks, 2, bs, dim)), fmt.encode(torch.randn(blocks, 2, bs, dim) * 2), fmt)
    contexts = [1, 9, 37, 200, 600]  # around the 8- and 16-position groups and the 256-position tiles
    tables = torch.stack([torch.randperm(blocks)[:-(-600 // bs)] for _ in contexts])
    meta = build_metadata(torch.zeros(len(contexts), dtype=torch.long), [c - 1 for c in contexts],
                          [1] * len(contexts), tables, bs, window or None, torch.device("cpu"))
    q = torch.randn(len(contexts), 14, dim)
    ref = torch_decode_attention(q, cache, meta, dim ** -0.5, torch.float32)
    got = kernels.decode_attention(q, cache[0], cache[1], fmt, meta.decode_block_tables.contiguous(),
                                   meta.decode_context_lens, window or None, dim ** -0.5)
    int8_queries = kernels.int8_dot_products and name in ("int8", "turboquant4")
    tol = 0.01 * ref.abs().max().item() if int8_queries else 2e-5
    assert (got - ref).abs().max().item() <= tol, (got - ref).abs().max()


@pytest.mark.parametrize("name", TYPES)
def test_kernel_attention_cut_into_parts_equals_one_pass(kernels, name):
    """One sequence on 16 threads: each KV head's 2,600 positions are cut into 8 parts (the last
    two past the end), attended apart and merged by their running maxima and sums; on one thread the
    context is one pass. The two agree to rounding in every stored format (TurboQuant's output is
    rotated back per part, which the merge's weighted sum commutes with)."""
    torch.manual_seed(6)
    fmt, bs, dim, n = KVFormat(name, 64), 16, 64, 2600
    blocks = -(-n // bs) + 4
    cache = PagedKV(fmt.encode(torch.randn(blocks, 2, bs, dim)), fmt.encode(torch.randn(blocks, 2, bs, dim) * 2), fmt)
    tables = torch.randperm(blocks)[None, :-(-n // bs)].contiguous()
    q = torch.randn(1, 14, dim)
    before = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 16):
            torch.set_num_threads(threads)
            runs.append(kernels.decode_attention(q, cache[0], cache[1], fmt, tables, torch.tensor([n]), None,
                                                 dim ** -0.5))
    finally:
        torch.set_num_threads(before)
    whole, parts = runs
    assert (parts - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()


# ---- through the engine ----

@pytest.fixture(scope="module")
def fp32_kv_logits(hf_models, cache_dir):
    out = {}
    for arch in ("qwen2", "mistral_swa", "qwen3_moe", "qwen3_5"):
        engine = LLMEngine(engine_settings(hf_models[arch][1], cache_dir), show_progress=False)
        out[arch] = run_logits(engine, PROMPT, 16)
    return out


@pytest.mark.parametrize("kernels_on", [True, False], ids=["anna_kernels", "torch_kernels"])
@pytest.mark.parametrize("arch", ["qwen2", "mistral_swa", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize("name", TYPES)
def test_logits_with_each_kv_type_stay_near_fp32_kv(hf_models, cache_dir, fp32_kv_logits, name, arch, kernels_on):
    """Prefill, then decode (the fused C stack where it serves), chunked or not: within the type's
    bound of the fp32-KV logits, the two kernel paths giving the same answer."""
    engine = LLMEngine(engine_settings(hf_models[arch][1], cache_dir, kv_cache_dtype=name, cpu_kernels=kernels_on),
                       show_progress=False)
    ref, ref_tokens = fp32_kv_logits[arch]
    logits, _ = run_logits(engine, PROMPT, 16, forced=ref_tokens)
    assert (logits - ref).norm() <= LOGIT_BOUND[name] * ref.norm()
    chunked, _ = run_logits(engine, PROMPT, 16, chunks=[5, 16, 3, 16], forced=ref_tokens)
    assert (chunked - logits).norm() <= 0.01 * ref.norm()  # chunks read the same stored rows
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("name", ["bfloat16", "int8", "turboquant4", "turboquant3"])
def test_kernel_paths_agree_and_the_fused_stack_serves_quantized_kv(hf_models, cache_dir, name):
    """The fused C decode stack (Anna's kernels) and torch's ops on the same stored rows: the same
    logits, within what int8 queries cost where VNNI scores int8 and TurboQuant 4-bit keys."""
    engines = [LLMEngine(engine_settings(hf_models["qwen2"][1], cache_dir, kv_cache_dtype=name, cpu_kernels=on),
                         show_progress=False) for on in (True, False)]
    assert engines[0].runner.decode_executor is not None
    assert engines[0].runner.decode_executor.applies(*_decode_probe(engines[0]))
    a, tokens = run_logits(engines[1], PROMPT, 16)  # torch's ops
    b, _ = run_logits(engines[0], PROMPT, 16, forced=tokens)
    assert (a - b).norm() <= 0.01 * a.norm()


def _decode_probe(engine: LLMEngine):
    meta = build_metadata(torch.zeros(1, dtype=torch.long), [3], [1], torch.zeros(1, 1, dtype=torch.long), 16,
                          None, torch.device("cpu"))
    return meta, 1, engine.runner.layer_caches


@pytest.mark.parametrize("name", ["fp8_e4m3", "turboquant3"])
def test_preemption_with_quantized_blocks_gives_the_outputs_of_a_roomy_pool(qwen2_dir, cache_dir, name):
    roomy = LLMEngine(engine_settings(qwen2_dir, cache_dir, kv_cache_dtype=name, enable_prefix_caching=False),
                      show_progress=False)
    expected = {}
    for rid, prompt, params in workload():
        roomy.add_request(rid, prompt, params)
        expected.update(drain(roomy))
    tight = LLMEngine(engine_settings(qwen2_dir, cache_dir, kv_cache_dtype=name, num_gpu_blocks_override=12,
                                      max_model_len=96, max_num_seqs=16), show_progress=False)
    assert drain(tight, {0: workload()}) == expected
    assert tight.scheduler.num_preemptions > 0
    assert_pool_free(tight)


def test_memory_release_of_quantized_blocks(qwen2_dir, cache_dir):
    engine = LLMEngine(engine_settings(qwen2_dir, cache_dir, kv_cache_dtype="turboquant4",
                                       num_gpu_blocks_override=1024, kv_release_chunk_blocks=16,
                                       memory_release_sweep_interval_s=0), show_progress=False)
    assert engine.memory.block_bytes == 2 * 2 * 2 * 16 * KVFormat("turboquant4", 16).row_bytes  # layers, K/V, heads
    prompt = [5 + (i * 11) % 600 for i in range(300)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", prompt, params)
    first = drain(engine)["a"]
    assert engine.memory.release("test")["kv_chunks"] > 0 and engine.memory.resident_bytes() == 0
    engine.add_request("b", prompt, params)
    assert drain(engine)["b"] == first  # recomputed into fresh pages: the same
    assert_pool_free(engine)


def test_memory_plan_counts_the_stored_bytes(qwen2_dir, cache_dir):
    plans = {name: LLMEngine(engine_settings(qwen2_dir, cache_dir, kv_cache_dtype=name, num_gpu_blocks_override=0,
                                             kv_cache_memory=0.01), show_progress=False).cache_plan
             for name in ("auto", "bfloat16", "turboquant4")}
    # tiny qwen2: 2 layers x K, V x 2 KV heads x head dim 16
    assert [p.bytes_per_token for p in plans.values()] == [2 * 2 * 2 * 64, 2 * 2 * 2 * 32, 2 * 2 * 2 * 10]
    assert plans["turboquant4"].num_tokens >= 3.1 * plans["bfloat16"].num_tokens
    text = plans["turboquant4"].describe(512)
    assert "turboquant4 rows, 80 bytes per token" in text and "max concurrency" in text


def test_prompt_cache_stays_off_for_quantized_kv_shared_through_prefix_blocks(qwen2_dir, cache_dir, caplog):
    with caplog.at_level("INFO", logger="anna.runtime.builder"):
        engine = LLMEngine(engine_settings(qwen2_dir, cache_dir, kv_cache_dtype="turboquant4", log_level="info"),
                           show_progress=False)
    assert engine.prompt_cache.size == 0
    assert "KV stored as turboquant4 is shared through them" in caplog.text
    on = LLMEngine(engine_settings(qwen2_dir, cache_dir, kv_cache_dtype="turboquant4", prompt_cache_size=2),
                   show_progress=False)
    prompt = list(range(3, 60))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    on.add_request("x", prompt, params)
    first = drain(on)["x"]
    on.add_request("y", prompt, params)
    assert drain(on)["y"] == first and on.prompt_cache.hits == 1  # its entries hold stored rows as they are


def test_the_setting_everywhere(qwen2_dir, cache_dir):
    s = ServeSettings(kv_cache_dtype="fp8").resolve(env={})
    assert s.values.kv_cache_dtype == "fp8"
    assert ServeSettings().resolve(env={"ANNA_KV_CACHE_DTYPE": "int8"}).values.kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServeSettings(kv_cache_dtype="q4_0").resolve(env={})
    llm = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
              num_gpu_blocks_override=64, kv_cache_dtype="fp8")  # vLLM's name for e4m3
    assert llm.llm_engine.runner.kv_caches[0].format.name == "fp8_e4m3"
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_bf16_kv_keeps_the_greedy_tokens_of_a_qwen2_5_0_5b_shape_model(tmp_path, cache_dir):
    """Qwen2.5-0.5B's layer shapes (hidden 896, 14 query heads, 2 KV heads of 64, 151,936-token
    vocabulary; 4 of its 24 layers, for time), random bf16 weights: greedy tokens with bf16 KV
    agree with fp32 KV on at least 90% of positions, each position fed the fp32 run's tokens."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "make_random_model.py"
    subprocess.run([sys.executable, str(script), "--shape", "qwen2.5-0.5b", "--layers", "4", "--out",
                    str(tmp_path)], check=True, capture_output=True)
    prompt = [(i * 37 + 11) % 700 + 3 for i in range(200)]
    runs = {}
    for name in ("auto", "bfloat16"):
        engine = LLMEngine(engine_settings(tmp_path, cache_dir, dtype="bfloat16", kv_cache_dtype=name,
                                           num_gpu_blocks_override=32), show_progress=False)
        ref_tokens = runs["auto"][1] if runs else None
        runs[name] = run_logits(engine, prompt, 64, forced=ref_tokens)
    ref, bf16 = runs["auto"][0], runs["bfloat16"][0]
    agree = (bf16[len(prompt) - 1:].argmax(-1) == ref[len(prompt) - 1:].argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
