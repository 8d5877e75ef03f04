"""Pre-quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors, FP8), hand-built here
in each format's documented layout (their quantizers need a GPU), loaded by Anna and compared
with the checkpoint's own values, dequantized here by each format's formula."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from anna.model.config import ModelLoadError
from anna.model.linear import QuantLinear
from anna.model.quantization import dequantize_int4, quantize_int4
from anna.runtime.engine import LLMEngine
from conftest import engine_settings
from helpers import hf_greedy, hf_logits, run_logits

PROMPT = [(i * 29 + 7) % 700 + 3 for i in range(23)]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's gemm packing: nibble i holds column ORDER[i]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def int_quantize(w: torch.Tensor, group: int, symmetric: bool, bits: int = 4):
    """Round-to-nearest groups of ``group`` input columns: q [N, K] (unsigned), zeros [N, G], scales [N, G]."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.float().view(n, k // group, group)
    if symmetric:
        scales = g.abs().amax(2) / (top / 2)
        zeros = torch.full_like(scales, (top + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = g.amin(2).clamp(max=0), g.amax(2).clamp(min=0)
        scales = (hi - lo) / top
        zeros = torch.round(-lo / scales).long()
    scales = scales.half().float()
    q = torch.clamp(torch.round(g / scales[:, :, None]) + zeros[:, :, None], 0, top).long().view(n, k)
    return q, zeros, scales.half()


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 (two's complement), as the packers store them."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(values: torch.Tensor, dim: int, bits: int = 4, order=None) -> torch.Tensor:
    """Pack 32/bits values per int32 word along ``dim``; value i of a word at bits i*bits
    (``order``: value i is element order[i] of the run, AWQ's interleaving)."""
    per = 32 // bits
    v = values.long().movedim(dim, -1)
    runs = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        runs = runs[..., order]
    words = sum((runs[..., i] & ((1 << bits) - 1)) << (bits * i) for i in range(per))
    return to_int32(words).movedim(-1, dim).contiguous()


def dequantized(q, zeros, scales, g_idx):
    """(q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]], element by element's formula."""
    return (q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]


def write_checkpoint(src: Path, dst: Path, quantization_config: dict, encode) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint at ``src`` whose projection weights ``encode(name, w)`` replaces by
    its tensors; returns the dequantized weight of each replaced layer (the reference's values)."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    values = {}
    for name in [n for n in state if n.rsplit(".", 2)[-2] in PROJECTIONS and n.endswith(".weight")]:
        prefix = name[: -len(".weight")]
        parts, value = encode(prefix, state.pop(name))
        state.update({f"{prefix}.{k}": v for k, v in parts.items()})
        values[name] = value
    save_file(state, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return values


def reference_model(model, values: dict[str, torch.Tensor]):
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, v in values.items():
            params[name].copy_(v)
    return ref


def gptq(group: int, symmetric: bool = True, act_order: bool = False, bits: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def encode(prefix: str, w: torch.Tensor):
        n, k = w.shape
        perm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)  # columns in act order form the groups
        q, zeros, scales = int_quantize(w[:, perm], group, symmetric, bits)
        q = q[:, torch.argsort(perm)]  # back in the checkpoint's column order
        parts = {"qweight": pack_along(q.T, 0, bits), "qzeros": pack_along((zeros - 1).T, 1, bits),
                 "scales": scales.T.contiguous(), "g_idx": g_idx}
        return parts, dequantized(q, zeros, scales, g_idx.long())

    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": symmetric,
              "checkpoint_format": "gptq"}
    return config, encode


def awq(group: int):
    def encode(prefix: str, w: torch.Tensor):
        q, zeros, scales = int_quantize(w, group, symmetric=False)
        parts = {"qweight": pack_along(q.T, 1, order=AWQ_ORDER), "qzeros": pack_along(zeros.T, 1, order=AWQ_ORDER),
                 "scales": scales.T.contiguous()}
        return parts, dequantized(q, zeros, scales, torch.arange(w.shape[1]) // group)

    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}, encode


def packed(group: int):
    """compressed-tensors pack-quantized, symmetric int4: stored value + 8, packed along K."""
    def encode(prefix: str, w: torch.Tensor):
        q, zeros, scales = int_quantize(w, group, symmetric=True)
        parts = {"weight_packed": pack_along(q, 1), "weight_scale": scales.to(torch.bfloat16),
                 "weight_shape": torch.tensor(list(w.shape))}
        return parts, dequantized(q, zeros, scales.to(torch.bfloat16), torch.arange(w.shape[1]) // group)

    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}}}
    return config, encode


def fp8_block(block: int):
    def encode(prefix: str, w: torch.Tensor):
        n, k = w.shape
        amax = w.float().abs().view(n // block, block, k // block, block).amax((1, 3))
        scale_inv = amax / 448.0
        full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)
        q = (w.float() / full).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale_inv}, q.float() * full

    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [block, block]}, encode


def fp8_compressed(strategy: str):
    """compressed-tensors FP8: a scale per output row ([N, 1]) or one for the tensor ([1])."""
    def encode(prefix: str, w: torch.Tensor):
        scale = w.float().abs().amax(1, keepdim=True) / 448.0 if strategy == "channel" else \
            (w.float().abs().amax() / 448.0).reshape(1)
        q = (w.float() / scale).to(torch.float8_e4m3fn)
        parts = {"weight": q, "weight_scale": scale}
        if prefix.endswith("k_proj"):  # a KV scale, as FP8-KV checkpoints carry one per attention layer
            parts["k_scale"] = torch.tensor(1.0)
        return parts, q.float() * scale

    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}}}}, encode


@pytest.fixture(scope="module")
def base(hf_models):
    return hf_models["qwen3"]


def make(base, tmp_path: Path, fmt) -> tuple[Path, object]:
    model, src = base
    config, encode = fmt
    values = write_checkpoint(src, tmp_path / "ckpt", config, encode)
    return tmp_path / "ckpt", reference_model(model, values)


def load(path: Path, cache_dir: Path, **kw) -> LLMEngine:
    return LLMEngine(engine_settings(path, cache_dir, disable_int4_cache=True, **kw), show_progress=False)


@pytest.mark.parametrize("name,fmt,group", [("gptq-g32", gptq(32), 32), ("gptq-g64", gptq(64), 64),
                                            ("compressed-tensors-g32", packed(32), 32)])
def test_symmetric_int4_is_repacked_exactly(name, fmt, group, base, cache_dir, tmp_path, caplog):
    path, ref = make(base, tmp_path, fmt)
    with caplog.at_level(logging.INFO):
        engine = load(path, cache_dir)
    assert (engine.settings.quantization, engine.settings.int4_group_size) == ("int4", group)
    assert any("14 layer(s) repacked into Anna's int4 as they are, 0 dequantized" in r.message
               for r in caplog.records)
    layer = engine.runner.model.layers[1]
    theirs = dict(ref.named_parameters())
    assert isinstance(layer.mlp.down_proj, QuantLinear)
    assert torch.equal(layer.mlp.down_proj.dequantized(), theirs["model.layers.1.mlp.down_proj.weight"])
    qkv = layer.self_attn.qkv_proj.dequantized()
    assert torch.equal(qkv[layer.self_attn.qkv_proj.shard_slice(2)], theirs["model.layers.1.self_attn.v_proj.weight"])
    logits, tokens = run_logits(engine, PROMPT, 6)
    assert rel(logits, hf_logits(ref, PROMPT + tokens[:-1])) < 0.02
    exact = load(path, cache_dir, int4_matmul="dequant")
    _, tokens = run_logits(exact, PROMPT, 8)
    assert tokens[:8] == hf_greedy(ref, PROMPT, 8)


@pytest.mark.parametrize("name,fmt", [("gptq-act-order", gptq(32, act_order=True)),
                                      ("gptq-asymmetric", gptq(32, symmetric=False)), ("awq-g64", awq(64))])
def test_zero_points_and_act_order_are_dequantized(name, fmt, base, cache_dir, tmp_path, caplog):
    path, ref = make(base, tmp_path, fmt)
    # in floats, the checkpoint's values exactly: the layout is read right
    floats = load(path, cache_dir, quantization="none")
    logits, tokens = run_logits(floats, PROMPT, 4)
    assert rel(logits, hf_logits(ref, PROMPT + tokens[:-1])) < 1e-5
    with caplog.at_level(logging.INFO):
        engine = load(path, cache_dir)
    assert engine.settings.quantization == "int4"
    assert "no exact form" in engine.settings.sources["quantization"]
    assert any("0 layer(s) repacked" in r.message and "14 dequantized" in r.message for r in caplog.records)
    # quantized again into Anna's symmetric groups: the second rounding, measured on one layer
    theirs = dict(ref.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    group = engine.settings.int4_group_size
    again = dequantize_int4(*quantize_int4(theirs, group), group)
    assert torch.equal(engine.runner.model.layers[1].mlp.down_proj.dequantized(), again)
    original = dict(base[0].named_parameters())["model.layers.1.mlp.down_proj.weight"]
    assert group == 32 and rel(again, theirs) < 1.3 * rel(theirs, original)  # about what the first one cost
    logits, tokens = run_logits(engine, PROMPT, 4)
    seq = PROMPT + tokens[:-1]
    first = rel(hf_logits(ref, seq), hf_logits(base[0], seq))  # what the checkpoint's own rounding costs
    assert rel(logits, hf_logits(ref, seq)) < 1.5 * first


def test_8_bit_gptq_is_anna_int8_in_its_groups(base, cache_dir, tmp_path):
    path, ref = make(base, tmp_path, gptq(64, bits=8))
    engine = load(path, cache_dir)
    assert (engine.settings.quantization, engine.settings.int8_group_size) == ("int8", 64)
    down = engine.runner.model.layers[0].mlp.down_proj
    assert torch.equal(down.dequantized(), dict(ref.named_parameters())["model.layers.0.mlp.down_proj.weight"])
    logits, tokens = run_logits(engine, PROMPT, 3)
    assert rel(logits, hf_logits(ref, PROMPT + tokens[:-1])) < 0.02
    floats = load(path, cache_dir, quantization="none")
    logits, tokens = run_logits(floats, PROMPT, 3)
    assert rel(logits, hf_logits(ref, PROMPT + tokens[:-1])) < 1e-5


@pytest.mark.parametrize("name,fmt", [("fp8-block", fp8_block(32)),
                                      ("compressed-tensors-fp8-channel", fp8_compressed("channel")),
                                      ("compressed-tensors-fp8-tensor", fp8_compressed("tensor"))])
def test_fp8_is_dequantized_to_the_serving_dtype(name, fmt, base, cache_dir, tmp_path, caplog):
    path, ref = make(base, tmp_path, fmt)
    with caplog.at_level(logging.INFO):
        engine = load(path, cache_dir)
    assert engine.settings.quantization == "none"
    assert "FP8 weights dequantized to the serving dtype" in engine.settings.sources["quantization"]
    logits, tokens = run_logits(engine, PROMPT, 4)
    assert rel(logits, hf_logits(ref, PROMPT + tokens[:-1])) < 1e-5
    if name.startswith("compressed-tensors"):
        assert any("KV scales (k_scale, v_scale) are ignored" in r.message and r.levelname == "WARNING"
                   for r in caplog.records)
    int8 = load(path, cache_dir, quantization="int8")  # the choice the log offers
    logits, tokens = run_logits(int8, PROMPT, 4)
    assert rel(logits, hf_logits(ref, PROMPT + tokens[:-1])) < 0.03


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3-bit weights is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}}},
     "compressed-tensors format 'pack-quantized' with int4 weights \\(group, symmetric=False\\)"),
])
def test_what_anna_cannot_run_is_refused_by_method(config, message, base, cache_dir, tmp_path):
    model, src = base
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    with pytest.raises(ModelLoadError, match=message) as info:
        load(tmp_path / "m", cache_dir)
    assert "Anna loads gptq" in str(info.value) and "missing tensors" not in str(info.value)


def test_a_layer_missing_a_part_is_named(base, cache_dir, tmp_path):
    path, _ = make(base, tmp_path, gptq(32))
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.qzeros"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="quantized layer model.layers.0.mlp.up_proj has"):
        load(path, cache_dir)
