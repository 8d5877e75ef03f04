"""The x86 kernel level: read from /proc/cpuinfo's text (the three CPUs this machine class has
come as), forced down by cpu_isa, refused above what the CPU has; and what the level routes: from
avx512_bf16 on, large bf16 matmuls run in bf16, checked against torch and, through a bf16 model,
against transformers' bf16 logits on every machine (torch computes bf16 anywhere; the level only
decides whether Anna asks it to)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from anna.platforms.cpu.isa import LEVELS, detect_isa

COMMON = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ssse3 sse4_1 sse4_2 popcnt avx"
ZEN3 = COMMON + " fma f16c avx2 bmi1 bmi2"
ZEN4 = ZEN3 + " avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni"
SAPPHIRE = ZEN4 + " avx512_fp16 amx_bf16 amx_tile amx_int8 avx_vnni"


def cpuinfo(flags: str, name: str = "Test CPU", model: int = 1) -> str:
    entry = f"processor\t: 0\nvendor_id\t: x\ncpu family\t: 25\nmodel\t\t: {model}\nmodel name\t: {name}\nflags\t\t: {flags}\n"
    return entry + "\n" + entry.replace("processor\t: 0", "processor\t: 1")


@pytest.mark.parametrize("flags, level", [(COMMON, "none"), (ZEN3, "avx2"), (ZEN4, "avx512_bf16"),
                                          (SAPPHIRE, "amx"), (ZEN3 + " avx512f avx512bw avx512dq avx512vl", "avx512"),
                                          (ZEN4.replace(" avx512_bf16", ""), "avx512_vnni")])
def test_levels_from_cpuinfo(flags, level):
    isa = detect_isa(cpuinfo(flags, "AMD Ryzen", 97))
    assert isa.available == isa.level == level
    assert isa.bf16_matmul == (level in ("avx512_bf16", "amx"))
    assert "AMD Ryzen (family 25 model 97)" in isa.describe() and f"kernel level {level}" in isa.describe()


def test_a_level_is_forced_down_never_up():
    for level in ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "none"):
        isa = detect_isa(cpuinfo(SAPPHIRE), force=level)
        assert isa.level == level and isa.available == "amx"
        assert "forced by cpu_isa" in isa.describe()
    assert not detect_isa(cpuinfo(SAPPHIRE), force="avx2").bf16_matmul
    with pytest.raises(ValueError, match="^cpu_isa: .* up to avx2, not amx"):
        detect_isa(cpuinfo(ZEN3), force="amx")
    with pytest.raises(ValueError, match="^cpu_isa: .* up to none, not avx2"):
        detect_isa(cpuinfo(COMMON), force="avx2")
    assert detect_isa("").level == "none"  # no /proc/cpuinfo: torch's kernels only


def test_this_machine_and_the_engine_agree(qwen2_dir, cache_dir):
    """The engine's routing follows the level detected here (a bf16 model: bf16 large matmuls and
    bf16 prefill attention where the CPU computes bf16 in hardware); forced to avx2 it takes
    today's path."""
    from anna import LLM

    here = detect_isa()
    assert here.level in ("none", *LEVELS)
    for force, bf16 in (("auto", here.bf16_matmul), ("avx2", False)):
        if force == "avx2" and not here.has("avx2"):
            continue
        llm = LLM(str(qwen2_dir), dtype="bfloat16", device="cpu", cache_dir=str(cache_dir), max_model_len=256,
                  num_gpu_blocks_override=32, cpu_isa=force)
        ops = llm.llm_engine.runner.model.norm.ops  # (one ops object for all layers)
        assert ops.routing.bf16_matmul == bf16
        assert ops.attention_dtype == (torch.bfloat16 if bf16 else torch.float32)  # prefill attention follows
        # ... on Anna's kernel (on AMX tiles at the amx level), or on torch's SDPA (oneDNN's bf16 tiles)
        # where the CPU has AMX and Anna's kernels could not be built with it
        tiles = ops.kernels is not None and ops.kernels.level == "amx"
        assert ops.routing.sdpa_min_tokens == (1 if bf16 and force == "auto" and here.has("amx") and not tiles else 0)
    fp32 = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=256,
               num_gpu_blocks_override=32)
    assert not fp32.llm_engine.runner.model.norm.ops.routing.bf16_matmul  # an fp32 model stays in fp32
    with pytest.raises(ValueError, match="^cpu_isa:"):
        LLM(str(qwen2_dir), cpu_isa="sse9", device="cpu", cache_dir=str(cache_dir))


def _dense(out_features: int, in_features: int, bias: bool) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(weight=torch.randn(out_features, in_features).to(torch.bfloat16) / in_features ** 0.5,
                           bias=torch.randn(out_features) if bias else None, profile_name=None, interleaved=False)


@pytest.mark.parametrize("bias", [False, True])
def test_the_bf16_large_matmul_is_torchs_bf16_matmul(bias):
    """bf16_matmul: the activations rounded to bf16, one bf16 GEMM, the bias added in fp32; off:
    the fp32 GEMM on the converted weight."""
    from anna.model.ops import LinearRouting
    from anna.platforms.cpu.ops import CpuTorchOps

    torch.manual_seed(0)
    layer = _dense(96, 64, bias)
    x = torch.randn(200, 64)
    on = CpuTorchOps(routing=LinearRouting(bf16_matmul=True)).linear(layer, x)
    off = CpuTorchOps(routing=LinearRouting(bf16_matmul=False)).linear(layer, x)
    want_on = F.linear(x.to(torch.bfloat16), layer.weight).float() + (layer.bias if bias else 0)
    want_off = F.linear(x, layer.weight.float(), layer.bias)
    assert on.dtype == off.dtype == torch.float32
    torch.testing.assert_close(on, want_on, rtol=0, atol=0)
    torch.testing.assert_close(off, want_off, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on, off, rtol=0.05, atol=0.1)  # the same matmul, at bf16's precision


@pytest.mark.parametrize("bias", [False, True])
def test_the_bf16_mlp_keeps_its_intermediate_in_bf16(bias):
    """bf16_matmul: gate_up's output and the gated product stay bf16 (what transformers computes
    for a bf16 model), only the block's output returns to fp32; off: the fp32 path."""
    from anna.model.layers import GatedMLP
    from anna.model.ops import LinearRouting
    from anna.platforms.cpu.ops import CpuTorchOps

    def mlp_on(ops: CpuTorchOps) -> GatedMLP:
        torch.manual_seed(0)
        mlp = GatedMLP(32, 48, bias, "silu", torch.bfloat16, ops)
        for p in mlp.parameters():
            p.data = (torch.randn(p.shape) / 6).to(p.dtype)
        return mlp

    x = torch.randn(200, 32)
    mlp = mlp_on(CpuTorchOps(routing=LinearRouting(bf16_matmul=True)))
    on = mlp(x)
    off = mlp_on(CpuTorchOps(routing=LinearRouting(bf16_matmul=False)))(x)
    gate_up = F.linear(x.to(torch.bfloat16), mlp.gate_up_proj.weight)
    if bias:
        gate_up += mlp.gate_up_proj.bias.to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    want_on = F.linear(F.silu(gate) * up, mlp.down_proj.weight).float() + (mlp.down_proj.bias.float() if bias else 0)
    bias_of = {name: None if layer.bias is None else layer.bias.float()
               for name, layer in (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj))}
    h = F.linear(x, mlp.gate_up_proj.weight.float(), bias_of["gate_up"])
    want_off = F.linear(F.silu(h[:, :48]) * h[:, 48:], mlp.down_proj.weight.float(), bias_of["down"])
    assert on.dtype == off.dtype == torch.float32
    torch.testing.assert_close(on, want_on, rtol=0, atol=0)
    torch.testing.assert_close(off, want_off, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on, off, rtol=0.05, atol=0.1)


def test_the_bf16_mlp_reuses_its_intermediate_buffers_without_aliasing_its_outputs():
    """The [gate | up] rows and their product go to buffers kept from call to call (ScratchBuffers):
    a smaller call reuses the memory, a larger one grows it, and no output shares it, so an output
    kept from one call is unchanged by the next."""
    from anna.model.layers import GatedMLP
    from anna.model.ops import LinearRouting
    from anna.platforms.cpu.ops import CpuTorchOps

    torch.manual_seed(0)
    ops = CpuTorchOps(routing=LinearRouting(bf16_matmul=True))
    mlp = GatedMLP(32, 48, False, "silu", torch.bfloat16, ops)
    for p in mlp.parameters():
        p.data = (torch.randn(p.shape) / 6).to(p.dtype)

    def want(x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x.to(torch.bfloat16), mlp.gate_up_proj.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, mlp.down_proj.weight).float()

    xs = [torch.randn(rows, 32) for rows in (200, 50, 300, 200)]
    outs, pointers = [], []
    for x in xs:
        outs.append(mlp(x))
        pointers.append(ops.scratch.take("gate_up", 1, 96, torch.bfloat16).data_ptr())
        torch.testing.assert_close(outs[-1], want(x), rtol=0, atol=0)
    assert pointers[0] == pointers[1] and pointers[2] == pointers[3]  # reused; grown once, for 300 rows
    for x, out in zip(xs, outs):  # every output intact after the later calls
        torch.testing.assert_close(out, want(x), rtol=0, atol=0)


def test_prompt_attention_runs_on_sdpa_from_the_routed_context_length(cache_dir):
    """routing.sdpa_min_tokens: a prompt chunk whose context has that many tokens or more attends on
    torch's SDPA (the torch ops' path, in attention_dtype), a shorter one on Anna's kernel; 0: the
    kernel at every length. Chunks after a cached prefix (a mask) and sliding windows follow the
    same rule."""
    from conftest import kernels_at_level

    from anna.model.attention import sdpa_attention
    from anna.model.ops import LinearRouting
    from anna.platforms.cpu.ops import CpuKernelOps

    kernels = kernels_at_level("avx2", cache_dir)
    torch.manual_seed(0)
    for sdpa in (0, 48):
        ops = CpuKernelOps(kernels, routing=LinearRouting(sdpa_min_tokens=sdpa))
        for tq, tk, window in ((47, 47, None), (48, 48, None), (16, 60, None), (16, 40, None), (60, 60, 20)):
            q, k, v = torch.randn(tq, 4, 16), torch.randn(tk, 2, 16), torch.randn(tk, 2, 16)
            qpos, kpos = torch.arange(tk - tq, tk).unsqueeze(1), torch.arange(tk).unsqueeze(0)
            mask = (kpos <= qpos) & (kpos > qpos - (window or tk)) if tq != tk or window else None
            got = ops.causal_attention(q, k, v, 0.25, mask, window)
            if sdpa and tk >= sdpa:
                want = sdpa_attention(q, k, v, 0.25, mask, torch.float32)
            else:
                want = kernels.causal_attention(q, k, v, 0.25, window)
            assert torch.equal(got, want), (sdpa, tq, tk, window)
            assert not torch.equal(sdpa_attention(q, k, v, 0.25, mask, torch.float32),
                                   kernels.causal_attention(q, k, v, 0.25, window))  # two paths, two results


def test_at_the_amx_level_bf16_prompt_attention_runs_on_tiles_or_on_sdpa_by_head_size(cache_dir):
    """A bf16 prompt's attention at the amx level (the emulated build where the CPU lacks AMX): on
    Anna's tile kernel for a head size it takes (a multiple of 32, up to 256), on torch's SDPA in
    bf16 for one it does not (oneDNN's tiles outrun the vdpbf16ps kernel on such a CPU), whatever
    the prompt's length, over itself and after a cached prefix."""
    from conftest import amx_kernels

    from anna.model.attention import sdpa_attention
    from anna.model.ops import LinearRouting
    from anna.platforms.cpu.ops import CpuKernelOps

    kernels = amx_kernels("native" if detect_isa().has("amx") else "emulated", cache_dir)
    ops = CpuKernelOps(kernels, routing=LinearRouting(bf16_matmul=True))
    ops.attention_dtype = torch.bfloat16
    torch.manual_seed(0)
    for dim, tiles in ((64, True), (32, True), (48, False), (16, False)):
        for tq, tk in ((5, 5), (70, 70), (16, 90)):
            q, k, v = torch.randn(tq, 4, dim), torch.randn(tk, 2, dim), torch.randn(tk, 2, dim)
            qpos, kpos = torch.arange(tk - tq, tk).unsqueeze(1), torch.arange(tk).unsqueeze(0)
            mask = kpos <= qpos if tq != tk else None
            got = ops.causal_attention(q, k, v, dim ** -0.5, mask)
            on_tiles = kernels.causal_attention(q, k, v, dim ** -0.5, bf16=True)
            on_sdpa = sdpa_attention(q, k, v, dim ** -0.5, mask, torch.bfloat16)
            assert kernels.tile_attention(dim) == tiles
            assert torch.equal(got, on_tiles if tiles else on_sdpa), (dim, tq, tk)
            assert not torch.equal(on_tiles, on_sdpa)  # two paths, two results


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_bf16_prefill_logits_stay_with_transformers(arch, hf_models, cache_dir, tmp_path):
    """A bf16 checkpoint, a 200-token prompt (every matmul past the weight-streaming kernel's 128
    rows): Anna's prefill logits, with large bf16 matmuls and prefill attention in bf16 (attention
    on AMX tiles at the amx level where the head size allows, on vdpbf16ps only where the CPU has
    AVX512-BF16) and in fp32, and with the attention on torch's
    SDPA instead of Anna's kernel (cpu_sdpa_min_tokens: the prompt whole, and in chunks of 64 that
    attend over their cached prefix through a mask), and Anna's kernel on those chunks too, are no farther from the exact result
    (transformers in fp32 on the same bf16 weights) than transformers' own bf16 run is, and pick
    the same top token as often."""
    from anna import LLM
    from conftest import VOCAB, engine_kernel_level, save_hf_model
    from helpers import hf_logits, run_logits

    level = engine_kernel_level()  # the CPU's, or the one ANNA_CPU_ISA forces
    hf = copy.deepcopy(hf_models[arch][0]).to(torch.bfloat16)  # (the session's model stays fp32)
    path = save_hf_model(hf, tmp_path / arch)
    torch.manual_seed(0)
    prompt = torch.randint(3, VOCAB, (200,)).tolist()
    hf_bf16 = hf_logits(hf, prompt)[: len(prompt)]
    exact = hf_logits(hf.float(), prompt)[: len(prompt)]
    got = {}
    for bf16, sdpa, chunks in ((True, 0, None), (False, 0, None), (True, 1, None), (True, 1, [64, 64, 64, 8]),
                               (True, 0, [64, 64, 64, 8])):
        llm = LLM(str(path), dtype="bfloat16", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
                  num_gpu_blocks_override=64)
        ops = llm.llm_engine.runner.model.norm.ops  # the one ops object every layer calls
        ops.routing = dataclasses.replace(ops.routing, bf16_matmul=bf16, sdpa_min_tokens=sdpa)
        ops.attention_dtype = torch.bfloat16 if bf16 and level.bf16_matmul else torch.float32
        got[bf16, sdpa, bool(chunks)] = run_logits(llm.llm_engine, prompt, 0, chunks)[0][: len(prompt)].float()

    def error(logits: torch.Tensor) -> tuple[float, float]:
        return (logits - exact).abs().max().item(), (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()

    hf_err, hf_agree = error(hf_bf16)
    for config, logits in got.items():
        err, agree = error(logits)
        assert err <= 1.1 * hf_err + 1e-3 and agree >= hf_agree - 0.02, (config, err, hf_err, agree, hf_agree)
    assert not torch.equal(got[True, 0, False], got[False, 0, False])  # the paths really differ
    kernels = llm.llm_engine.runner.model.norm.ops.kernels
    dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    # SDPA against Anna's kernel shows in the logits where attention runs in bf16. In fp32 (a CPU
    # without bf16 arithmetic) the two differ in their last bits only, which the o_proj's bf16 input
    # rounds away (a Zen 3 gave equal logits); that route is checked on its own by
    # test_prompt_attention_runs_on_sdpa_from_the_routed_context_length.
    if level.bf16_matmul and not (kernels.level == "amx" and not kernels.tile_attention(dim)):  # (amx: SDPA in both)
        assert not torch.equal(got[True, 0, False], got[True, 1, False])


def test_bf16_dot_products_stay_with_transformers_through_prefill_and_fused_decode(hf_models, cache_dir, tmp_path):
    """A bf16 checkpoint with cpu_bf16_dot_min_rows=1: a 40-token prefill (the weight-streaming
    kernel's rows) and 8 decode steps through the fused C stack and the lm_head multiply x rounded to
    bf16 on vdpbf16ps; their logits are no farther from the exact ones (transformers in fp32 on the
    same bf16 weights) than transformers' own bf16 run, with the same top tokens as often, and differ
    from the kernel's fp32 path (cpu_bf16_dot_min_rows=0)."""
    from anna import LLM
    from conftest import save_hf_model
    from helpers import hf_logits, run_logits

    here = detect_isa()
    if not here.has("avx512_bf16"):
        pytest.skip(f"bf16 dot products: this CPU ({here.model_name}) has instruction sets up to {here.available}")
    hf = copy.deepcopy(hf_models["qwen2"][0]).to(torch.bfloat16)
    path = save_hf_model(hf, tmp_path / "qwen2")
    prompt = [(i * 37 + 11) % 700 + 3 for i in range(40)]
    got, tokens = {}, {}
    for rows in (1, 0):
        llm = LLM(str(path), dtype="bfloat16", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
                  num_gpu_blocks_override=64, cpu_bf16_dot_min_rows=rows, cpu_isa="auto")  # (not a forced level)
        assert llm.llm_engine.runner.model.norm.ops.routing.bf16_dot_rows == rows
        assert llm.llm_engine.decode_executor == "graph"  # decode runs the fused C stack
        logits, tokens[rows] = run_logits(llm.llm_engine, prompt, 8)
        got[rows] = logits.float()
    seq = prompt + tokens[1][:-1]
    hf_bf16, exact = hf_logits(hf, seq), hf_logits(hf.float(), seq)

    def error(logits: torch.Tensor) -> tuple[float, float]:
        return (logits - exact).abs().max().item(), (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()

    hf_err, hf_agree = error(hf_bf16)
    err, agree = error(got[1])
    assert err <= 1.1 * hf_err + 1e-3 and agree >= hf_agree - 0.02, (err, hf_err, agree, hf_agree)
    assert not torch.equal(got[1], got[0])


def test_the_mlp_in_row_tiles_gives_the_whole_mlps_logits(hf_models, cache_dir, tmp_path):
    """cpu_mlp_tile_rows: a 200-token prefill whose gated MLPs run in tiles of 64 rows (4 tiles, the
    last one short) gives the logits of the MLPs run whole: bit for bit on the packed int4 kernel
    (every row of x is its own), within rounding for the fp32 model (tiles on the weight-streaming
    kernel, the whole MLP on the fp32 GEMM); and the tiles are real."""
    from anna.runtime.engine import LLMEngine
    from conftest import engine_settings
    from helpers import run_logits

    model, path = hf_models["qwen2"]
    prompt = [(i * 37 + 11) % 700 + 3 for i in range(200)]
    for quantization in ("int4", "none"):
        got, calls = {}, []
        for tile in (64, 0):
            engine = LLMEngine(engine_settings(path, cache_dir, quantization=quantization, int4_matmul="packed",
                                               cpu_mlp_tile_rows=tile, int4_cache_dir=str(tmp_path)),
                               show_progress=False)
            ops = engine.runner.model.norm.ops
            assert ops.routing.mlp_tile_rows == tile
            rows_of = type(ops)._gated_mlp_rows
            ops._gated_mlp_rows = lambda mlp, x, rows_of=rows_of, ops=ops: calls.append(x.shape[0]) or rows_of(ops, mlp, x)
            got[tile] = run_logits(engine, prompt, 0)[0]
        layers = len(engine.runner.model.layers)
        assert calls == [64, 64, 64, 8] * layers + [200] * layers
        if quantization == "int4":
            assert torch.equal(got[64], got[0])
        else:
            torch.testing.assert_close(got[64], got[0], rtol=1e-5, atol=1e-5)


def test_int4_dequantized_gemm_in_bf16_stays_with_fp32(hf_models, cache_dir, tmp_path):
    """A bf16 checkpoint quantized to int4, a 200-token prefill (past the packed kernel's M limit,
    set low here): the dequantized GEMM in bf16 gives the fp32 one's logits within 1% (norm),
    far below int4's own error."""
    from anna import LLM
    from conftest import VOCAB, save_hf_model
    from helpers import run_logits

    path = save_hf_model(copy.deepcopy(hf_models["qwen2"][0]).to(torch.bfloat16), tmp_path / "qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(3, VOCAB, (200,)).tolist()
    got = {}
    for bf16 in (True, False):
        llm = LLM(str(path), dtype="bfloat16", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
                  num_gpu_blocks_override=64, quantization="int4", int4_gemv_m_threshold=16,
                  int4_cache_dir=str(tmp_path / "int4"))
        ops = llm.llm_engine.runner.model.norm.ops
        ops.routing = dataclasses.replace(ops.routing, bf16_matmul=bf16)
        ops.attention_dtype = torch.bfloat16 if bf16 and detect_isa().bf16_matmul else torch.float32
        got[bf16] = run_logits(llm.llm_engine, prompt, 0)[0][: len(prompt)].float()
    rel = ((got[True] - got[False]).norm() / got[False].norm()).item()
    assert 0 < rel < 0.01, rel


@pytest.mark.parametrize("level", ["avx2", "avx512", "avx512_vnni", "amx"])
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_every_kernel_level_stays_with_transformers_through_the_model(level, quantization, hf_models, cache_dir,
                                                                      tmp_path):
    """Each kernel build the CPU has (the others skipped, saying why), forced with cpu_isa, serves
    a whole model: the fp32 model's prefill and fused-stack decode logits match transformers', the
    int4 model's match transformers on the dequantized weights (the packed kernels round x to int8
    per 32 values)."""
    from anna.runtime.engine import LLMEngine
    from conftest import engine_settings, kernels_at_level
    from helpers import assert_logits_close, fake_quantized, hf_logits, run_logits

    kernels_at_level(level, cache_dir)  # skips a level this CPU lacks
    model, path = hf_models["qwen2"]
    engine = LLMEngine(engine_settings(path, cache_dir, cpu_isa=level, quantization=quantization,
                                       int4_cache_dir=str(tmp_path)), show_progress=False)
    assert engine.runner.model.norm.ops.kernels.level == level
    assert engine.decode_executor == "graph"  # decode runs the fused C stack built at this level
    prompt = [(i * 37 + 11) % 700 + 3 for i in range(40)]
    logits, tokens = run_logits(engine, prompt, 6)
    seq = prompt + tokens[:-1]
    if quantization == "none":
        assert_logits_close(logits, hf_logits(model, seq))
    else:
        fake = hf_logits(fake_quantized(model, quantization), seq)
        assert ((logits - fake).norm() / fake.norm()).item() < 0.02


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_prefill_on_emulated_amx_tiles_stays_with_transformers(quantization, hf_models, cache_dir,
                                                                         tmp_path):
    """The amx level's int4 and int8 paths through a whole model, on CPUs without AMX: the
    avx512_vnni engine's ops switched to the build whose tile instructions are emulated in C. A
    40-token prefill (its matmuls on tiles of 16 rows, the last one short) and 6 decode steps give
    the vnni engine's logits to the bit, and transformers' on the dequantized weights."""
    from anna.runtime.engine import LLMEngine
    from conftest import amx_kernels, engine_settings
    from helpers import fake_quantized, hf_logits, run_logits

    amx = amx_kernels("emulated", cache_dir)
    model, path = hf_models["qwen2"]
    prompt = [(i * 37 + 11) % 700 + 3 for i in range(40)]
    got = {}
    for build in ("vnni", "amx"):
        engine = LLMEngine(engine_settings(path, cache_dir, cpu_isa="avx512_vnni", quantization=quantization,
                                           int4_matmul="packed", int4_cache_dir=str(tmp_path)), show_progress=False)
        ops = engine.runner.model.norm.ops
        if build == "amx":
            ops.kernels = amx
        qgemm, rows = ops.kernels.qgemm, []
        ops.kernels.qgemm = lambda x, *a, qgemm=qgemm, rows=rows: rows.append(x.shape[0]) or qgemm(x, *a)
        got[build] = run_logits(engine, prompt, 6)
        del ops.kernels.qgemm
        assert 40 in rows  # the prefill's matmuls ran on this build
    assert torch.equal(got["vnni"][0], got["amx"][0]) and got["vnni"][1] == got["amx"][1]
    logits, tokens = got["amx"]
    fake = hf_logits(fake_quantized(model, quantization), prompt + tokens[:-1])
    assert ((logits - fake).norm() / fake.norm()).item() < 0.02


def _assert_prefill_runs_on(llm, kernels, matmul: str, gated_act: str, hf, prompt: list[int]) -> None:
    """The prompt's prefill (logits of every position) runs its attention projections, down
    projections and lm_head on ``kernels.<matmul>`` and each gated MLP's first matmul on
    ``kernels.<gated_act>``, all with every prompt row, and its logits are no farther from the exact
    result (transformers in fp32 on the bf16 weights of ``hf``) than transformers' own bf16 run is,
    with the same top tokens as often."""
    from helpers import hf_logits, run_logits

    calls: list[tuple[str, int]] = []
    for name in (matmul, gated_act):
        kernel = getattr(kernels, name)
        setattr(kernels, name, lambda x, *a, kernel=kernel, name=name, **kw: calls.append((name, x.shape[0])) or kernel(x, *a, **kw))
    try:
        logits = run_logits(llm.llm_engine, prompt, 0)[0][: len(prompt)].float()
    finally:
        for name in (matmul, gated_act):
            delattr(kernels, name)
    layers, rows = hf.config.num_hidden_layers, len(prompt)
    assert calls.count((matmul, rows)) == 3 * layers + 1 and calls.count((gated_act, rows)) == layers, calls
    hf_bf16 = hf_logits(hf, prompt)[:rows]
    exact = hf_logits(hf.float(), prompt)[:rows]  # (.float() converts hf in place: last)
    err, hf_err = ((t - exact).abs().max().item() for t in (logits, hf_bf16))
    agree, hf_agree = ((t.argmax(-1) == exact.argmax(-1)).float().mean().item() for t in (logits, hf_bf16))
    assert err <= 1.1 * hf_err + 1e-3 and agree >= hf_agree - 0.02, (err, hf_err, agree, hf_agree)


def test_bf16_prefill_on_amx_tiles_stays_with_transformers(hf_models, cache_dir, tmp_path):
    """A bf16 checkpoint's 200-token prefill at the amx level (the native build on an AMX CPU, the
    one whose tile instructions are emulated in C elsewhere): the attention projections and the
    down projection (and the lm_head) run on the tile matmul, the gated MLP's first matmul with its activation on
    the fused one, all on the weights as stored, and the logits are no farther from the exact
    result (transformers in fp32 on the bf16 weights) than transformers' own bf16 run is."""
    from anna import LLM
    from conftest import VOCAB, amx_kernels, save_hf_model

    here = detect_isa()
    amx = amx_kernels("native" if here.has("amx") else "emulated", cache_dir)
    hf = copy.deepcopy(hf_models["qwen2"][0]).to(torch.bfloat16)
    path = save_hf_model(hf, tmp_path / "qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(3, VOCAB, (200,)).tolist()
    llm = LLM(str(path), dtype="bfloat16", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
              num_gpu_blocks_override=64, cpu_isa="amx" if here.has("amx") else "avx512_vnni")
    ops = llm.llm_engine.runner.model.norm.ops
    ops.kernels = amx
    ops.routing = dataclasses.replace(ops.routing, bf16_matmul=True, sdpa_min_tokens=0)
    ops.attention_dtype = torch.bfloat16
    _assert_prefill_runs_on(llm, amx, "tile_matmul", "tile_gated_act", hf, prompt)


def test_bf16_prefill_on_avx2_panels_stays_with_transformers(hf_models, cache_dir, tmp_path):
    """A bf16 checkpoint's 200-token prefill at the avx2 level (every x86 CPU Anna's kernels run on
    has it): the attention projections, the down projection and the lm_head run on the
    register-blocked GEMM, the gated MLP's first matmul with its activation on the fused one, all on
    the weights as stored, and the logits are no farther from the exact result (transformers in fp32
    on the bf16 weights) than transformers' own bf16 run is, with the same top tokens as often."""
    from anna import LLM
    from conftest import VOCAB, save_hf_model

    hf = copy.deepcopy(hf_models["qwen2"][0]).to(torch.bfloat16)
    path = save_hf_model(hf, tmp_path / "qwen2")
    torch.manual_seed(0)
    prompt = torch.randint(3, VOCAB, (200,)).tolist()
    llm = LLM(str(path), dtype="bfloat16", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
              num_gpu_blocks_override=64, cpu_isa="avx2")
    kernels = llm.llm_engine.runner.model.norm.ops.kernels
    assert kernels.level == "avx2"
    _assert_prefill_runs_on(llm, kernels, "panel_matmul", "panel_gated_act", hf, prompt)


def test_the_amx_level_asks_linux_for_the_tiles_and_falls_back_when_refused(cache_dir, caplog):
    """Before the amx build is built or loaded, Linux is asked for the tile data state (arch_prctl
    ARCH_REQ_XCOMP_PERM): an AMX CPU grants it and runs that build; elsewhere (a CPU said to have
    AMX that does not) the refusal is logged and the avx512_vnni build runs instead."""
    from anna.platforms.cpu.isa import CpuIsa
    from anna.platforms.cpu.kernels import build_cpu_kernels, request_amx_tiles

    here = detect_isa()
    if not here.has("avx512_vnni"):
        pytest.skip(f"the avx512_vnni build that a refusal falls back to: this CPU ({here.model_name}) has "
                    f"instruction sets up to {here.available}")
    with caplog.at_level(logging.WARNING, logger="anna.platforms.cpu.kernels"):
        kernels = build_cpu_kernels(cache_dir, isa=CpuIsa(here.model_name, here.flags, "amx", "amx"))
    if here.has("amx"):
        assert request_amx_tiles() == 0 and kernels.level == "amx"
    else:
        assert request_amx_tiles() > 0 and kernels.level == "avx512_vnni"
        assert "Linux did not let Anna use the AMX tiles" in caplog.text


@pytest.mark.parametrize("build", ["emulated", "native"])
def test_the_amx_builds_tiles_pass_their_self_check_in_a_child_process(build, cache_dir):
    """The self-check (the tiles against the lanes on fixed data, bit for bit) passes on the build
    that runs here: the emulated one on an AVX-512 VNNI CPU, the native one on an AMX CPU."""
    from anna.platforms.cpu.kernels import amx_self_check
    from conftest import amx_kernels

    assert amx_self_check(amx_kernels(build, cache_dir).library) == ""


@pytest.mark.parametrize("body, why", [
    ("__builtin_trap();", "died of SIGILL in their self-check"),  # a tile instruction the CPU lacks
    ("return 3;", "gave 3 outputs unlike the avx512_vnni path's in their self-check"),
    ("return -1;", "were refused the tiles by Linux in their self-check"),
])
def test_a_failed_amx_self_check_is_reported_not_fatal(body, why, tmp_path):
    """What the child process ends with is what the warning says; this process lives on."""
    import shutil
    import subprocess

    from anna.platforms.cpu.kernels import amx_self_check

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in library")
    source, library = tmp_path / "check.c", tmp_path / "check.so"
    source.write_text(f"int anna_amx_self_check(void) {{ {body} }}\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    assert amx_self_check(library) == why
    assert amx_self_check(tmp_path / "missing.so").startswith("could not run their self-check (OSError")


def test_a_compiler_without_amx_runs_the_avx512_vnni_build(cache_dir, tmp_path, monkeypatch, caplog):
    """Where Linux grants the tiles but the C compiler cannot build AMX code (GCC before 11), the
    avx512_vnni build runs, not torch's kernels. The compiler here refuses -mamx-tile; Linux's
    grant is given as an AMX CPU's Linux gives it."""
    import shutil

    from anna.platforms.cpu import kernels as cpu_kernels
    from anna.platforms.cpu.isa import CpuIsa
    from conftest import kernels_at_level

    kernels_at_level("avx512_vnni", cache_dir)  # skips a CPU without it; built once per session, copied below
    here = detect_isa()
    store = tmp_path / "cache"
    (store / "kernels").mkdir(parents=True)
    for built in (cache_dir / "kernels").glob("anna_cpu_kernels_avx512_vnni_*.so"):
        shutil.copy(built, store / "kernels")
    compiler = tmp_path / "cc-without-amx"
    compiler.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -mamx-tile ] && exit 1; done\nexec gcc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setattr(cpu_kernels, "request_amx_tiles", lambda: 0)
    with caplog.at_level(logging.WARNING, logger="anna.platforms.cpu.kernels"):
        kernels = cpu_kernels.build_cpu_kernels(store, str(compiler), CpuIsa(here.model_name, here.flags, "amx", "amx"))
    assert kernels is not None and kernels.level == "avx512_vnni"
    assert "The amx level's kernels could not be built" in caplog.text


def test_packed_kernels_bound_by_default_is_the_cpus():
    """-1 (the default) resolves by where the dequantized GEMM would run: on AMX tiles (a bf16 model
    on an AMX CPU) from 128 rows on, else the packed kernel up to 2048, for int4 and int8 alike; a
    value that was set wins."""
    from anna.core.config import ServeSettings, resolve_settings
    from anna.platforms.base import linear_routing

    cpu = resolve_settings(ServeSettings(model="m"), env={}).sections.cpu
    bounds = lambda routing: (routing.int4_gemv_m_threshold, routing.int8_gemv_m_threshold)  # noqa: E731
    assert bounds(linear_routing(cpu)) == (2048, 2048)
    assert bounds(linear_routing(cpu, bf16_matmul=True)) == (2048, 2048)  # AVX512-BF16 without tiles
    assert bounds(linear_routing(cpu, amx=True)) == (2048, 2048)  # a float model's GEMM is fp32
    assert bounds(linear_routing(cpu, bf16_matmul=True, amx=True)) == (128, 128)
    cpu = resolve_settings(ServeSettings(model="m", int4_gemv_m_threshold=64, int8_gemv_m_threshold=0),
                           env={}).sections.cpu
    assert bounds(linear_routing(cpu, bf16_matmul=True, amx=True)) == (64, 0)
