"""Weight-only int8/int4: formats, every execution strategy, model accuracy, the int4 layout cache."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from anna.model.linear import QuantLinear
from anna.model.ops import LinearRouting, QuantFormat
from anna.platforms.cpu.kernels import LEVEL_CFLAGS
from anna.platforms.cpu.ops import CpuKernelOps
from anna.model.quantization import (dequantize_int4, dequantize_int8, pack_int4, quantize_int4, quantize_int8,
                                     unpack_int4)
from anna.runtime.engine import LLMEngine
from conftest import engine_settings, fresh_cache_dir, kernels_at_level
from helpers import fake_quantized, hf_logits, run_logits

PROMPT = [(i * 29 + 7) % 700 + 3 for i in range(37)]


@pytest.fixture(scope="module", params=list(LEVEL_CFLAGS))
def kernels(request, cache_dir):
    """The kernels built for each level this CPU has (the others are skipped, with the reason)."""
    return kernels_at_level(request.param, cache_dir)


def test_int4_pack_unpack_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (12, 256), generator=g, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (12, 128) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_quantization_error_is_bounded_per_group(group):
    w = torch.randn(48, 256)
    packed, scale = quantize_int4(w, group)
    err = (dequantize_int4(packed, scale, group) - w).abs().view(48, -1, group)
    assert (err <= scale[:, :, None] / 2 + 1e-6).all()  # round to nearest: at most half a step


def test_int8_quantization_error_is_bounded():
    w = torch.randn(48, 256)
    q, scale = quantize_int8(w)
    assert ((dequantize_int8(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-6).all()
    q, scale = quantize_int8(w, 32)  # a scale per 32 columns
    assert scale.shape == (48, 8) and scale.dtype == torch.float16
    err = (dequantize_int8(q, scale, 32) - w).abs().view(48, 8, 32)
    assert (err <= scale.float()[:, :, None] / 2 + 1e-6).all()


def make_layer(kind: str, group: int, kernels, strategy: str, out_features=(70, 37), k=256) -> QuantLinear:
    """A loaded layer, still row-major. 107 rows: 6 pairs of blocks of 8, one odd block and 3 tail
    rows (both kinds' layout): every path of the kernels."""
    quant = QuantFormat(kind, group, int8_group_size=group) if kind == "int8" else QuantFormat(kind, group)
    ops = CpuKernelOps(kernels, quant, LinearRouting(int4_matmul=strategy, int4_gemv_m_threshold=4))
    layer = QuantLinear(k, list(out_features), bias=True, dtype=torch.float32, ops=ops)
    g = torch.Generator().manual_seed(1)
    for shard, n in enumerate(out_features):
        layer.load("weight", shard, torch.randn(n, k, generator=g) * 0.1, "w", "test")
        layer.load("bias", shard, torch.randn(n, generator=g), "b", "test")
    return layer


# int8: one scale per row (group 0) or per group (a GGUF's Q8_0: 32)
@pytest.mark.parametrize("kind, group", [("int8", 0), ("int8", 32), ("int8", 128), ("int4", 32), ("int4", 64),
                                         ("int4", 128)])
@pytest.mark.parametrize("strategy", ["packed", "dequant", "auto", "no_kernels"])
def test_every_strategy_matches_the_dequantized_reference(kind, group, strategy, kernels):
    layer = make_layer(kind, group, None if strategy == "no_kernels" else kernels,
                       "auto" if strategy == "no_kernels" else strategy)
    ref_w = (dequantize_int8(layer.qweight, layer.scales, group) if kind == "int8"
             else dequantize_int4(layer.qweight, layer.scales, group))
    layer.interleave_for_cpu_kernel()
    assert layer.interleaved == (strategy != "no_kernels")
    rows = torch.tensor([0, 5, 9, 103, 106])  # embedding lookups: in blocks and in the tail
    torch.testing.assert_close(layer.dequantized(rows), ref_w[rows])
    for m in [1, 2, 3, 4, 5, 8, 16, 33]:
        x = torch.randn(m, 256)
        ref = x @ ref_w.t() + layer.bias
        out = layer(x)
        # the packed kernel quantizes x to int8 per 32 values: about 0.5% relative error
        tol = 2e-2 if layer.uses_packed_kernel(m) else 1e-4
        assert ((out - ref).norm() / ref.norm()).item() < tol, (m, layer.uses_packed_kernel(m))
    assert layer.uses_packed_kernel(1) == (strategy in ("packed", "auto") or (kind == "int8" and strategy != "no_kernels"))


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the packed kernels see it: rounded to int8 per run of 32 values (scale max|x| / 127),
    with the kernels' fp32 operations (x times 1 / scale), so that ties round alike."""
    runs = x.view(x.shape[0], -1, 32)
    scale = runs.abs().amax(dim=2, keepdim=True) / 127.0
    return (torch.round(runs * (1.0 / scale)) * scale).view_as(x)


# int8: one scale per row (group 0) or per group (a GGUF's Q8_0: 32)
@pytest.mark.parametrize("build", ["avx2", "avx512_vnni", "amx_emulated"])
def test_int4_outputs_past_the_caches_keep_their_bits(build, cache_dir):
    """An int4 output of 4 MiB or more (a 16-row step's logits) is written with non-temporal stores
    where its rows are whole cache lines: each row must hold what a small call, whose output stays
    in the caches, computes for it (bits), and stay exact given its int8 x. 65,536 rows (16 rows of
    x: 4 MiB, streamed; 32 rows: the AMX tiles; the experts' grouped call) and 65,544 (an odd block
    of 8: not streamed)."""
    if build == "amx_emulated":
        from conftest import amx_kernels
        kernels = amx_kernels("emulated", cache_dir)
    else:
        kernels = kernels_at_level(build, cache_dir)
    g = torch.Generator().manual_seed(7)
    for n in (65536, 65544):
        ops = CpuKernelOps(kernels, QuantFormat("int4", 32), LinearRouting(int4_matmul="packed"))
        layer = QuantLinear(64, [n], bias=True, dtype=torch.float32, ops=ops)
        layer.load("weight", 0, torch.randn(n, 64, generator=g) * 0.1, "w", "test")
        layer.load("bias", 0, torch.randn(n, generator=g), "b", "test")
        ref_w = dequantize_int4(layer.qweight, layer.scales, 32).double()
        layer.interleave_for_cpu_kernel()
        for m in (16, 32):
            x = torch.randn(m, 64, generator=g)
            out = layer(x)
            small = torch.cat([layer(x[i:i + 2]) for i in range(0, m, 2)])  # 512 KB each: not streamed
            assert torch.equal(out, small), (n, m)
            ref = int8_blocks(x).double() @ ref_w.t() + layer.bias.double()
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5, (n, m)
        # the experts' grouped call (a mixture-of-experts prefill): 8 MiB in all, in groups of 20 and 12 rows
        x = torch.randn(32, 64, generator=g)
        table = torch.tensor([layer.qweight.data_ptr()], dtype=torch.int64)
        scales = torch.tensor([layer.scales.data_ptr()], dtype=torch.int64)
        starts = torch.tensor([0, 20, 32], dtype=torch.int64)
        out = kernels.qgemm_experts(x, table, scales, torch.tensor([0, 0]), starts, layer.kind, 32, n)
        pairs = [kernels.qgemm_experts(x[i:i + 2], table, scales, torch.tensor([0]), torch.tensor([0, 2]), layer.kind,
                                       32, n) for i in range(0, 32, 2)]
        assert torch.equal(out, torch.cat(pairs)), n


@pytest.mark.parametrize("kind, group", [("int8", 0), ("int8", 32), ("int8", 128), ("int4", 32), ("int4", 64),
                                         ("int4", 128)])
# 107 rows; one block of 8 + 3; only a tail; more rows than one slice of int4_row_lanes (8,192)
@pytest.mark.parametrize("out_features", [(70, 37), (9, 2), (3,), (8200, 11)])
def test_packed_kernel_is_exact_given_its_int8_x(kind, group, out_features, kernels):
    """With x rounded to int8 the same way, the packed kernel's integer arithmetic is exact: only
    fp32 rounding remains. Tight enough to catch any misplaced weight, scale or offset."""
    layer = make_layer(kind, group, kernels, "packed", out_features)
    ref_w = (dequantize_int8(layer.qweight, layer.scales, group) if kind == "int8"
             else dequantize_int4(layer.qweight, layer.scales, group)).double()
    layer.interleave_for_cpu_kernel()
    for m in [1, 2, 3, 4, 5, 7, 9, 16, 37, 128] + ([130] if kind == "int4" else []):
        assert layer.uses_packed_kernel(m)
        x = torch.randn(m, 256)
        ref = int8_blocks(x).double() @ ref_w.t() + layer.bias.double()
        out = layer(x).double()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, m


@pytest.mark.parametrize("signs", [(1, -1, 1, -1), (1, -1, -1, 1), (-1, 1, 1, -1), (1, 1, 1, 1)])
def test_int4_kernel_is_exact_at_the_largest_sums(signs, kernels):
    """The int4 kernel's int16 sums take the stored nibbles q = w + 8 and start at -8 * sum(x),
    so they may pass the int16 range on the way and must still end exact. Weights at +-7 and x at
    +-127, with the signs chosen per position mod 4 (the two int16 sums of a row), drive each
    sum to its largest size: 16 rows through the row-lanes kernel, 3 through the tail path."""
    wa, wb, xa, xb = signs
    k = 64
    lane_a = (torch.arange(k) % 4) < 2  # positions 0, 1 (mod 4): the first int16 sum of a row
    w_row = torch.where(lane_a, 7.0 * wa, 7.0 * wb)
    ops = CpuKernelOps(kernels, QuantFormat("int4", 32), LinearRouting(int4_matmul="packed"))
    layer = QuantLinear(k, [19], bias=False, dtype=torch.float32, ops=ops)
    layer.load("weight", 0, w_row.expand(19, k).clone(), "w", "test")
    ref_w = dequantize_int4(layer.qweight, layer.scales, 32).double()
    assert torch.equal(ref_w, w_row.double().expand(19, k))  # the weights are exactly +-7
    layer.interleave_for_cpu_kernel()
    for m in [1, 5]:  # one row of x, and a tile of several
        x = torch.where(lane_a, float(xa), float(xb)).expand(m, k).clone()
        ref = int8_blocks(x).double() @ ref_w.t()
        out = layer(x).double()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-6, m


@pytest.mark.parametrize("group", [0, 32])
def test_int8_kernel_is_exact_at_the_largest_products(group, kernels):
    """int8 weights at +-127 against x at +-127, every sign pattern within each lane's 4 columns:
    the VNNI build reads the weights as w + 128 (their top bit flipped) and starts each run's sum
    at -128 * sum(x), the AVX2 build multiplies |w| by x carrying w's sign (maddubs pairs at their
    largest, 2 x 127 x 127); both must end exact. 16 rows through a unit's lanes, 8 through the odd
    block, 3 through the tail path, at 1 and 9 rows of x (a second tile)."""
    k = 128
    col = torch.arange(k)
    ops = CpuKernelOps(kernels, QuantFormat("int8", 0, int8_group_size=group), LinearRouting())
    layer = QuantLinear(k, [27], bias=False, dtype=torch.float32, ops=ops)
    rows = torch.stack([torch.where((col + r) % 3 == 0, -1.0, 1.0) for r in range(27)])
    layer.load("weight", 0, rows, "w", "test")
    ref_w = dequantize_int8(layer.qweight, layer.scales, group).double()
    assert layer.qweight.abs().min() == 127  # every weight at the largest size
    layer.interleave_for_cpu_kernel()
    for m in [1, 9]:
        x = torch.stack([torch.where((col // (1 + i)) % 2 == 0, 1.0, -1.0) for i in range(m)])
        ref = int8_blocks(x).double() @ ref_w.t()
        out = layer(x).double()
        assert ((out - ref).norm() / ref.norm()).item() < 1e-6, m


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packed_kernel_rows_do_not_depend_on_the_thread_count(kind, kernels):
    """Threads share the output rows in chunks and take each other's leftovers (work_split.h):
    every row must be computed exactly once, whatever the number of threads, including threads
    with no rows of their own (8 threads for 7 units) and the int4 odd block and tail rows."""
    threads = torch.get_num_threads()
    for out_features in [(70, 37), (8200, 11)]:
        layer = make_layer(kind, 0 if kind == "int8" else 32, kernels, "packed", out_features)
        layer.interleave_for_cpu_kernel()
        x = torch.randn(16, 256)
        try:
            torch.set_num_threads(1)
            want = layer(x)
            for n in [2, 3, 8]:
                torch.set_num_threads(n)
                assert torch.equal(layer(x), want), (out_features, n)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("kind, group", [("int8", 0), ("int4", 32), ("int4", 128)])
def test_expert_kernel_equals_one_call_per_expert(kind, group, kernels):
    """anna_qgemm_experts (several experts' matmuls in one call, as a mixture-of-experts layer
    runs them) gives exactly what one qgemm per expert gives: with 107 rows per expert (an odd
    block of 8 and a tail), groups of 1 to 9 rows, an unused expert and experts out of order."""
    layers = []
    for seed in range(4):
        ops = CpuKernelOps(kernels, QuantFormat(kind, group or 32), LinearRouting(int4_matmul="packed"))
        layer = QuantLinear(256, 107, bias=False, dtype=torch.float32, ops=ops)
        layer.load("weight", 0, torch.randn(107, 256, generator=torch.Generator().manual_seed(seed)) * 0.1, "w", "t")
        layer.interleave_for_cpu_kernel()
        layers.append(layer)
    weights = torch.tensor([lin.qweight.data_ptr() for lin in layers], dtype=torch.int64)
    scales = torch.tensor([lin.scales.data_ptr() for lin in layers], dtype=torch.int64)
    ids, sizes = [3, 0, 2], [9, 1, 4]  # expert 1 unused
    starts = torch.tensor([0, 9, 10, 14], dtype=torch.int64)
    x = torch.randn(sum(sizes), 256)
    out = kernels.qgemm_experts(x, weights, scales, torch.tensor(ids), starts, layers[0].kind, layers[0].group, 107)
    expected = torch.cat([layers[e](x[starts[g]:starts[g + 1]]) for g, e in enumerate(ids)])
    assert torch.equal(out, expected)


def test_auto_routes_by_m(kernels):
    layer = make_layer("int4", 32, kernels, "auto")
    layer.interleave_for_cpu_kernel()
    assert layer.uses_packed_kernel(4) and not layer.uses_packed_kernel(5)
    layer.ops = CpuKernelOps(kernels, layer.ops.quant, LinearRouting(int4_gemv_m_threshold=0))
    assert not layer.uses_packed_kernel(1)  # 0 means always dequant


def test_int8_routes_by_its_own_bound(kernels):
    """int8 layers follow int8_gemv_m_threshold (not int4's, nor the weight-streaming kernel's
    cpu_gemv_max_rows), and both sides of the bound give the layer's product."""
    layer = make_layer("int8", 0, kernels, "dequant")  # (int4_matmul says nothing to int8)
    ref_w = dequantize_int8(layer.qweight, layer.scales, 0)
    layer.interleave_for_cpu_kernel()
    layer.ops = CpuKernelOps(kernels, layer.ops.quant, LinearRouting(gemv_max_rows=1, int4_gemv_m_threshold=0,
                                                                     int8_gemv_m_threshold=4))
    assert layer.uses_packed_kernel(4) and not layer.uses_packed_kernel(5)
    for m in (4, 5):
        x = torch.randn(m, 256)
        ref = x @ ref_w.t() + layer.bias
        tol = 2e-2 if m == 4 else 1e-4  # the packed kernel rounds x to int8 per 32 values
        assert ((layer(x) - ref).norm() / ref.norm()).item() < tol, m
    layer.ops = CpuKernelOps(kernels, layer.ops.quant, LinearRouting(int8_gemv_m_threshold=0))
    assert not layer.uses_packed_kernel(1)  # 0 means always dequant


@pytest.mark.parametrize("quant, bound", [("int8", 0.04), ("int4", 0.35)])
def test_quantized_model_logits(quant, bound, hf_models, cache_dir, tmp_path):
    """Two checks: (1) against the same model with dequantized weights, Anna's quantized execution
    agrees within 2% (relative norm; the packed kernels quantize activations to int8 per 32
    values); (2) against full precision, the stated accuracy of these random tiny models:
    relative logit error (norm) under 4% for int8 and 35% for int4."""
    model, path = hf_models["qwen2"]
    engine = LLMEngine(engine_settings(path, cache_dir, quantization=quant, int4_cache_dir=str(tmp_path)),
                       show_progress=False)
    assert engine.runner.model.embed_tokens is None  # tied embedding: the quantized lm_head is the only copy
    logits, tokens = run_logits(engine, PROMPT, 6)
    seq = PROMPT + tokens[:-1]
    fake = hf_logits(fake_quantized(model, quant), seq)
    assert ((logits - fake).norm() / fake.norm()).item() < 0.02
    ref = hf_logits(model, seq)
    err = ((logits - ref).norm() / ref.norm()).item()
    assert 1e-4 < err < bound, err


def test_untied_model_quantizes_lm_head_and_keeps_embedding(hf_models, cache_dir, tmp_path):
    model, path = hf_models["llama3"]
    engine = LLMEngine(engine_settings(path, cache_dir, quantization="int8"), show_progress=False)
    m = engine.runner.model
    assert isinstance(m.lm_head, QuantLinear) and m.embed_tokens is not None
    logits, tokens = run_logits(engine, PROMPT, 2)
    ref = hf_logits(fake_quantized(model, "int8"), PROMPT + tokens[:-1])
    assert ((logits - ref).norm() / ref.norm()).item() < 0.02


def load_int4(path, cache_dir, caplog, **kw) -> tuple[LLMEngine, bool]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="anna.weights.loader"):
        engine = LLMEngine(engine_settings(path, cache_dir, quantization="int4", **kw), show_progress=False)
    hit = any("Loaded the int4 layout from" in r.message for r in caplog.records)
    return engine, hit


def cache_entry(model_dir):
    entries = [p for p in (model_dir / ".anna" / "int4_cache").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1
    return entries[0]


def test_int4_cache_hit_stale_corrupt_truncated(hf_models, cache_dir, tmp_path, caplog):
    src = hf_models["qwen3"][1]
    path = tmp_path / "m"
    shutil.copytree(src, path)
    first, hit = load_int4(path, cache_dir, caplog)
    assert not hit
    reference, _ = run_logits(first, PROMPT, 3)
    second, hit = load_int4(path, cache_dir, caplog)
    assert hit
    assert torch.equal(run_logits(second, PROMPT, 3)[0], reference)

    part = sorted(cache_entry(path).glob("part-*.safetensors"))[0]
    data = bytearray(part.read_bytes())
    data[-10] ^= 0xFF  # corrupt one byte of tensor data
    part.write_bytes(bytes(data))
    third, hit = load_int4(path, cache_dir, caplog)
    assert not hit and any("corrupt" in r.message for r in caplog.records)
    assert torch.equal(run_logits(third, PROMPT, 3)[0], reference)
    _, hit = load_int4(path, cache_dir, caplog)
    assert hit  # rebuilt

    part = sorted(cache_entry(path).glob("part-*.safetensors"))[0]
    part.write_bytes(part.read_bytes()[:100])  # truncated
    _, hit = load_int4(path, cache_dir, caplog)
    assert not hit

    (path / "model.safetensors").touch()  # the checkpoint changed: a new key, the old entry is not used
    _, hit = load_int4(path, cache_dir, caplog)
    assert not hit
    _, hit = load_int4(path, cache_dir, caplog, int4_group_size=64)  # another layout: another entry
    assert not hit


def test_int4_cache_entries_are_per_layout(hf_models, cache_dir, tmp_path, caplog):
    """Entries hold the layout the model runs: one saved for Anna's CPU kernels is never read by a
    model running without them (it gets its own row-major entry), and each reads back its own."""
    path = tmp_path / "m"
    shutil.copytree(hf_models["qwen3"][1], path)
    kernels, hit = load_int4(path, cache_dir, caplog)
    assert not hit and kernels.runner.model.lm_head.interleaved
    plain, hit = load_int4(path, cache_dir, caplog, cpu_kernels=False)
    assert not hit and not plain.runner.model.lm_head.interleaved
    for settings in ({}, {"cpu_kernels": False}):
        again, hit = load_int4(path, cache_dir, caplog, **settings)
        assert hit
        reference = kernels if not settings else plain
        assert torch.equal(run_logits(again, PROMPT, 2)[0], run_logits(reference, PROMPT, 2)[0])


def test_int4_cache_falls_back_when_the_model_dir_is_not_writable(hf_models, cache_dir, tmp_path, caplog):
    path = tmp_path / "ro"
    shutil.copytree(hf_models["qwen2"][1], path)
    (path / ".anna").write_text("not a directory")  # nothing can be created under the model dir
    user_cache = fresh_cache_dir(tmp_path / "user-cache", cache_dir)
    _, hit = load_int4(path, user_cache, caplog)  # the settings' cache_dir is the user cache dir
    assert not hit
    assert list((user_cache / "int4_cache").glob("*/*/manifest.json"))
    _, hit = load_int4(path, user_cache, caplog)
    assert hit


def test_int4_cache_can_be_disabled(hf_models, cache_dir, tmp_path, caplog):
    path = tmp_path / "off"
    shutil.copytree(hf_models["qwen2"][1], path)
    load_int4(path, cache_dir, caplog, disable_int4_cache=True)
    _, hit = load_int4(path, cache_dir, caplog, disable_int4_cache=True)
    assert not hit and not (path / ".anna").exists()


@pytest.mark.parametrize("kind, group", [("int8", 0), ("int8", 32), ("int4", 32), ("int4", 128)])
def test_the_vnni_build_gives_the_avx2_builds_bits(kind, group, cache_dir):
    """vpdpbusd sums the same integer products exactly as AVX2's maddubs does (the int4 int16 sums
    wrap and end exact), so the two builds' packed matmuls agree to the bit at every M the
    routing can send them (1..130), with odd blocks and tail rows."""
    builds = [kernels_at_level(level, cache_dir) for level in ("avx2", "avx512_vnni")]
    layers = [make_layer(kind, group, k, "packed", (70, 37)) for k in builds]
    for layer in layers:
        layer.interleave_for_cpu_kernel()
    assert torch.equal(layers[0].qweight, layers[1].qweight)
    g = torch.Generator().manual_seed(3)
    for m in range(1, 131):
        x = torch.randn(m, 256, generator=g)
        assert torch.equal(layers[0](x), layers[1](x)), m


@pytest.mark.parametrize("build", ["emulated", "native"])
@pytest.mark.parametrize("kind, group", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 0), ("int8", 32),
                                         ("int8", 128)])
def test_quantized_matmuls_on_amx_tiles_give_the_vnni_builds_bits(build, kind, group, cache_dir):
    """The amx level's packed path (from 16 rows of x on, tiles of 16 rows: int4 on TDPBSUD with
    the stored nibbles as the unsigned operand, int8 on TDPBSSD straight from the weights) sums the
    same integer products as vpdpbusd and scales them in the same fp32 operations, so it gives the
    avx512_vnni build's bits at every M 1..130 (a short last tile, the odd block of 8 rows and the
    tail rows on the way); so does the experts' grouped call, whose groups of fewer than 16 rows
    stay on vpdpbusd. The emulated build runs that code on any AVX-512 VNNI CPU; the native one
    needs AMX."""
    from conftest import amx_kernels

    amx = amx_kernels(build, cache_dir)
    vnni = kernels_at_level("avx512_vnni", cache_dir)
    layers = [make_layer(kind, group, k, "packed") for k in (vnni, amx)]
    for layer in layers:
        layer.interleave_for_cpu_kernel()
    g = torch.Generator().manual_seed(5)
    for m in range(1, 131):
        x = torch.randn(m, 256, generator=g)
        assert torch.equal(layers[0](x), layers[1](x)), m
    weights = torch.tensor([layers[0].qweight.data_ptr()] * 2, dtype=torch.int64)
    scales = torch.tensor([layers[0].scales.data_ptr()] * 2, dtype=torch.int64)
    ids, starts = torch.tensor([1, 0, 1], dtype=torch.int64), torch.tensor([0, 20, 23, 63], dtype=torch.int64)
    x = torch.randn(63, 256, generator=g)
    got = [k.qgemm_experts(x, weights, scales, ids, starts, layers[0].kind, group, 107) for k in (vnni, amx)]
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("kind, group", [("int8", 0), ("int8", 32), ("int4", 32), ("int4", 128)])
def test_dequantizing_to_bf16_rounds_the_fp32_values(kind, group, kernels):
    """The bf16 operand of a dequantized bf16 GEMM is the fp32 dequantization rounded to nearest
    even, for every row: in blocks, the int4 odd block and the tail."""
    layer = make_layer(kind, group, kernels, "dequant", (70, 37))
    layer.interleave_for_cpu_kernel()
    args = (layer.qweight, layer.scales, layer.kind, layer.group, layer.in_features)
    fp32 = kernels.dequant(*args).clone()
    bf16 = kernels.dequant(*args, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.to(torch.bfloat16))
    rows = torch.tensor([0, 9, 103, 106])
    assert torch.equal(kernels.dequant(*args, rows=rows, dtype=torch.bfloat16), fp32[rows].to(torch.bfloat16))
