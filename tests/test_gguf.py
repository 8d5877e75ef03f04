"""GGUF files: written by the gguf package's own writer (benchmarks/export_gguf.py), served by
Anna, compared with transformers' GGUF loader (which dequantizes with the gguf package) or with
the model rebuilt from the file's dequantized values."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from anna import LLM, SamplingParams
from anna.model.config import ModelLoadError
from anna.model.linear import QuantLinear
from anna.model.quantization import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from anna.runtime.engine import LLMEngine
from anna.weights.tokenizer import Tokenizer
from conftest import engine_settings, save_hf_model
from helpers import hf_greedy, hf_logits, run_logits

PROMPT = [(i * 29 + 7) % 700 + 3 for i in range(23)]
_spec = importlib.util.spec_from_file_location(
    "export_gguf", Path(__file__).resolve().parents[1] / "benchmarks" / "export_gguf.py")
export_gguf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(export_gguf)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def gguf_files(hf_models, tmp_path_factory):
    """(arch, outtype) -> the exported file, one directory per file (as users keep them)."""
    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch in ("qwen2", "llama2_mha_tied", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"):
        for outtype in ("f16", "q4_0", "q8_0"):
            out = root / f"{arch}-{outtype}" / f"{arch}-{outtype}.gguf"
            out.parent.mkdir()
            export_gguf.export(hf_models[arch][1], out, outtype)
            files[arch, outtype] = out
    return files


def gguf_engine(path: Path, cache_dir: Path, **kw) -> LLMEngine:
    return LLMEngine(engine_settings(path, cache_dir, **kw), show_progress=False)


def transformers_from_gguf(path: Path):
    """transformers' own GGUF loader: the gguf package's dequantization, its own name mapping
    and its own undoing of llama.cpp's q/k permutation."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama2_mha_tied", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"])
def test_an_f16_gguf_serves_the_checkpoint_it_was_written_from(arch, hf_models, gguf_files, cache_dir):
    """Every architecture, the hybrid Qwen3.5 family included (written in llama.cpp's layout: value
    heads tiled, norms as 1 + w, A_log as -exp(A_log); test_export_matches_llama_cpps_converter)."""
    engine = gguf_engine(gguf_files[arch, "f16"], cache_dir)
    assert engine.settings.quantization == "none"
    logits, tokens = run_logits(engine, PROMPT, 4)
    ref = hf_logits(hf_models[arch][0], PROMPT + tokens[:-1])
    assert rel(logits, ref) < 5e-3  # the file's fp16 rounding of every matrix


@pytest.mark.parametrize("arch", ["qwen2", "llama2_mha_tied"])
def test_q4_0_is_anna_int4_byte_for_byte_and_matches_transformers(arch, gguf_files, cache_dir, caplog):
    path = gguf_files[arch, "q4_0"]
    with caplog.at_level(logging.INFO):
        engine = gguf_engine(path, cache_dir, disable_int4_cache=True)
    assert (engine.settings.quantization, engine.settings.int4_group_size) == ("int4", 32)
    assert "mostly Q4_0" in engine.settings.sources["quantization"]
    assert any("Q4_0" in r.message and "as it is stored" in r.message for r in caplog.records)
    ref_model = transformers_from_gguf(path)
    # every layer holds exactly the file's values: no float round trip
    ours = engine.runner.model
    theirs = dict(ref_model.named_parameters())
    q = ours.layers[0].self_attn.qkv_proj
    assert isinstance(q, QuantLinear)
    rows = q.shard_slice(0)
    assert torch.equal(q.dequantized()[rows], theirs["model.layers.0.self_attn.q_proj.weight"])
    down = ours.layers[1].mlp.down_proj
    assert torch.equal(down.dequantized(), theirs["model.layers.1.mlp.down_proj.weight"])
    logits, tokens = run_logits(engine, PROMPT, 6)
    assert rel(logits, hf_logits(ref_model, PROMPT + tokens[:-1])) < 0.02  # x rounded to int8 per 32 by the kernel
    # the same values in fp32 arithmetic: transformers' greedy tokens exactly
    exact = gguf_engine(path, cache_dir, disable_int4_cache=True, int4_matmul="dequant")
    _, tokens = run_logits(exact, PROMPT, 8)
    assert tokens[:-1] == hf_greedy(ref_model, PROMPT, 8)[:len(tokens) - 1]


def test_q4_0_experts_and_qk_norms_load_exactly(hf_models, gguf_files, cache_dir):
    """Qwen3-MoE (transformers' GGUF loader does not read this file's experts): against the
    checkpoint with each matrix replaced by its Q4_0 values, quantized by the gguf package."""
    import copy

    model = copy.deepcopy(hf_models["qwen3_moe"][0])
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):  # Q4_0 in the file, all but the router
                q = gguf.quants.quantize(p.detach().float().reshape(-1, p.shape[-1]).numpy(), q4_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, q4_0)).view_as(p))
    engine = gguf_engine(gguf_files["qwen3_moe", "q4_0"], cache_dir, disable_int4_cache=True, int4_matmul="dequant")
    logits, tokens = run_logits(engine, PROMPT, 4)
    assert rel(logits, hf_logits(model, PROMPT + tokens[:-1])) < 1e-3


def test_q8_0_is_anna_int8_in_groups_of_32(hf_models, gguf_files, cache_dir, caplog):
    with caplog.at_level(logging.INFO):
        engine = gguf_engine(gguf_files["qwen2", "q8_0"], cache_dir)
    assert (engine.settings.quantization, engine.settings.int8_group_size) == ("int8", 32)
    assert any("Q8_0" in r.message and "as it is stored" in r.message for r in caplog.records)
    ref = transformers_from_gguf(gguf_files["qwen2", "q8_0"])
    down = engine.runner.model.layers[0].mlp.down_proj
    assert torch.equal(down.dequantized(), dict(ref.named_parameters())["model.layers.0.mlp.down_proj.weight"])
    logits, tokens = run_logits(engine, PROMPT, 4)
    assert rel(logits, hf_logits(ref, PROMPT + tokens[:-1])) < 0.02
    # with a scale per row (int8_group_size 0) the file's values are quantized once more
    per_row = gguf_engine(gguf_files["qwen2", "q8_0"], cache_dir, int8_group_size=0)
    file_values = dict(ref.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(per_row.runner.model.layers[0].mlp.down_proj.dequantized(),
                       dequantize_int8(*quantize_int8(file_values)))


def test_an_explicit_quantization_overrides_the_files(gguf_files, hf_models, cache_dir):
    engine = gguf_engine(gguf_files["qwen3", "q4_0"], cache_dir, quantization="none")
    assert engine.settings.quantization == "none"
    int4 = gguf_engine(gguf_files["qwen3", "q4_0"], cache_dir, int4_matmul="dequant", disable_int4_cache=True)
    a, tokens = run_logits(engine, PROMPT, 3)
    b, _ = run_logits(int4, PROMPT, 3, forced=tokens)
    assert rel(a, b) < 1e-4  # the same dequantized values, held as floats


# ---- K-quants: hand-built blocks (the gguf package dequantizes them but has no quantizer) ----

K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=800, max_position_embeddings=512, rms_norm_eps=1e-6,
               tie_word_embeddings=False)
K_TYPES = {"q_proj": "Q6_K", "k_proj": "Q4_K", "v_proj": "Q5_K", "o_proj": "Q6_K", "gate_proj": "Q4_K",
           "up_proj": "Q3_K", "down_proj": "Q2_K", "lm_head": "Q6_K"}


def random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small fp16 super-block scales (d, and dmin where the type has one)."""
    t = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[t]
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale = np.array([2e-4], dtype=np.float16).view(np.uint8)
    if qtype == "Q6_K":  # ... int8 scales[16], then d
        data[..., -2:] = scale
    elif qtype in ("Q4_K", "Q5_K"):  # d, dmin first
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    elif qtype == "Q2_K":  # ... d, dmin last
        data[..., -4:-2] = scale
        data[..., -2:] = scale
    elif qtype == "Q3_K":  # ... d last
        data[..., -2:] = scale
    return data.reshape(rows, -1)


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """A Qwen3 of K-quant-sized rows whose matrices are K-quant blocks; and the transformers model
    holding the blocks' values, dequantized by the gguf package."""
    import transformers

    cfg = transformers.Qwen3Config(**K_SHAPE)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("kquant")
    save_hf_model(model, root / "hf")
    rng = np.random.default_rng(0)
    values: dict[str, np.ndarray] = {}

    def encode(name: str, array: np.ndarray):
        kind = next((t for key, t in K_TYPES.items() if f"{key}." in name), None)
        if kind is None:
            return None
        data = random_blocks(array.shape[0], array.shape[1], kind, rng)
        values[name] = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
        return data, gguf.GGMLQuantizationType[kind]

    path = root / "m" / "k.gguf"
    path.parent.mkdir()
    export_gguf.export(root / "hf", path, "f16", encode=encode)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, v in values.items():
            params[name].copy_(torch.from_numpy(v))
        for name, p in params.items():  # the file's other matrices are F16
            if p.dim() == 2 and name not in values:
                p.copy_(p.half().float())
    return path, model


def test_k_quants_are_dequantized_at_load(k_quant_file, cache_dir, caplog):
    path, model = k_quant_file
    with caplog.at_level(logging.INFO):
        engine = gguf_engine(path, cache_dir, quantization="none")
    for qtype in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        assert any(r.message.startswith(f"GGUF {qtype}:") and "dequantized" in r.message for r in caplog.records)
    logits, tokens = run_logits(engine, PROMPT, 3)
    assert rel(logits, hf_logits(model, PROMPT + tokens[:-1])) < 1e-4


def test_k_quants_choose_anna_format_by_bits(k_quant_file, cache_dir, caplog):
    path, model = k_quant_file
    with caplog.at_level(logging.INFO):
        engine = gguf_engine(path, cache_dir, disable_int4_cache=True)  # mostly 2- to 5-bit: int4
    assert (engine.settings.quantization, engine.settings.int4_group_size) == ("int4", 32)
    # the lm_head (Q6_K) in 8 bits, as the file keeps it in more than the layers' 4
    assert isinstance(engine.runner.model.lm_head, QuantLinear) and engine.runner.model.lm_head.kind == 0
    assert any("GGUF Q6_K: the lm_head dequantized at load and quantized again to Anna's int8 (group 32)" in r.message
               for r in caplog.records)
    assert any(r.message.startswith("GGUF Q6_K: 4 tensor(s)") for r in caplog.records)  # q_proj, o_proj x 2 layers
    down = engine.runner.model.layers[1].mlp.down_proj  # Q2_K blocks, quantized again to int4 groups of 32
    file_values = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(down.dequantized(), dequantize_int4(*quantize_int4(file_values, 32), 32))
    logits, tokens = run_logits(engine, PROMPT, 3)
    # random K-quant blocks are far from Gaussian weights, and 6-bit ones lose most in 4 bits
    assert rel(logits, hf_logits(model, PROMPT + tokens[:-1])) < 0.3


# ---- tokenizer, chat template, refusals, the layout cache ----

def test_the_vocabulary_and_chat_template_come_from_the_file(hf_models, gguf_files, cache_dir):
    llm = LLM(model=str(gguf_files["qwen2", "q4_0"]), cache_dir=str(cache_dir), max_model_len=512,
              num_gpu_blocks_override=64, log_level="warning")
    ours, original = llm.get_tokenizer(), Tokenizer(hf_models["qwen2"][1])
    for text in ["Hello world, 12345 times!", "<|im_start|>user\nhi<|im_end|>", "  spaces\tand\nlines ünï"]:
        assert ours.encode(text) == original.encode(text)
        assert ours.decode(original.encode(text), skip_special_tokens=False) == text
    assert ours.chat_template == original.chat_template
    assert ours.eos_token == original.eos_token
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_directory_holding_one_gguf_is_served(gguf_files, cache_dir):
    engine = gguf_engine(gguf_files["qwen3", "f16"].parent, cache_dir)
    assert engine.settings.quantization == "none"


def test_the_int4_layout_cache_covers_a_gguf(gguf_files, cache_dir, caplog, tmp_path):
    path = tmp_path / "copy.gguf"
    path.write_bytes(gguf_files["qwen3", "q4_0"].read_bytes())
    first = gguf_engine(path, cache_dir)
    ref, tokens = run_logits(first, PROMPT, 3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="anna.weights.loader"):
        second = gguf_engine(path, cache_dir)
    assert any("Loaded the int4 layout from" in r.message for r in caplog.records)
    again, _ = run_logits(second, PROMPT, 3, forced=tokens)
    assert torch.equal(ref, again)


def rewrite(src: Path, dst: Path, *, arch: str | None = None, tokenizer_model: str | None = None,
            extra: dict | None = None) -> Path:
    """A copy of a GGUF with some metadata changed."""
    reader = gguf.GGUFReader(str(src))
    arch_name = arch or reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(dst), arch_name)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in (extra or {}):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.model" and tokenizer_model:
            value = tokenizer_model
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for key, (value, vtype) in (extra or {}).items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_what_anna_cannot_serve_is_refused_by_name(gguf_files, cache_dir, tmp_path, hf_models):
    src = gguf_files["qwen2", "f16"]
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'gemma2' is not served; Anna serves GGUF files of"):
        gguf_engine(rewrite(src, tmp_path / "gemma.gguf", arch="gemma2"), cache_dir)
    spm = rewrite(src, tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(ModelLoadError, match=r"vocabulary type 'llama' cannot be rebuilt.*--tokenizer"):
        gguf_engine(spm, cache_dir)
    engine = gguf_engine(spm, cache_dir, tokenizer=str(hf_models["qwen2"][1]))  # with the original tokenizer: served
    assert engine.settings.quantization == "none"
    unknown_pre = rewrite(src, tmp_path / "pre.gguf", extra={"tokenizer.ggml.pre": ("deepseek-llm",
                                                                                     gguf.GGUFValueType.STRING)})
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'deepseek-llm' is not known to Anna.*--tokenizer"):
        gguf_engine(unknown_pre, cache_dir)
    split = rewrite(src, tmp_path / "part.gguf", extra={"split.count": (3, gguf.GGUFValueType.UINT16)})
    with pytest.raises(ModelLoadError, match="split GGUF"):
        gguf_engine(split, cache_dir)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        gguf_engine(truncated, cache_dir)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        gguf_engine(not_gguf, cache_dir)
    both = tmp_path / "two"
    both.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (both / name).write_bytes(src.read_bytes())
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files"):
        gguf_engine(both, cache_dir)


def test_a_llama_3_rotary_scaling_is_read_from_its_factors(hf_models, cache_dir, tmp_path):
    """llama.cpp writes Llama 3.1's scaling as rope_freqs.weight; Anna recovers the parameters and
    refuses factors that are not Llama 3's."""
    from anna.weights.gguf_checkpoint import _llama3_rope_scaling

    head_dim, theta = 64, 500000.0
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1.0) / 3.0
    factors = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)))

    class Reader:
        def __init__(self, data):
            self.tensors = [type("T", (), {"name": "rope_freqs.weight", "data": data})()]

    cfg = {"head_dim": head_dim, "rope_theta": theta}
    got = _llama3_rope_scaling(Reader(factors.astype(np.float32)), cfg, tmp_path)
    assert got == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
    with pytest.raises(ModelLoadError, match="not Llama 3's scaling"):
        _llama3_rope_scaling(Reader((factors * 1.5).astype(np.float32)), cfg, tmp_path)


def test_export_writes_what_the_tokenizer_config_says(hf_models, gguf_files):
    reader = gguf.GGUFReader(str(gguf_files["qwen2", "f16"]))
    assert reader.get_field("tokenizer.ggml.pre").contents() == "gpt-2"  # the demo tokenizer splits as GPT-2
    template = json.loads((hf_models["qwen2"][1] / "tokenizer_config.json").read_text())["chat_template"]
    assert reader.get_field("tokenizer.chat_template").contents() == template


def llama_cpp_bin() -> Path | None:
    """llama.cpp's binaries: LLAMA_CPP_BIN (a build's bin folder), else llama-server on PATH."""
    import os
    import shutil

    folder = os.environ.get("LLAMA_CPP_BIN")
    if folder:
        return Path(folder)
    found = shutil.which("llama-server")
    return Path(found).parent if found else None


@pytest.mark.skipif(llama_cpp_bin() is None, reason="needs llama.cpp (LLAMA_CPP_BIN=<build>/bin, or llama-server on "
                                                    "PATH); benchmarks/results/gguf holds the 0.5B-shape run")
def test_llama_cpp_quantized_q4_0_gives_llama_cpp_tokens(hf_models, cache_dir, tmp_path):
    """A file exported here and quantized by llama.cpp's own llama-quantize: Anna's greedy tokens
    are llama.cpp's where the choice is clear; where llama.cpp's first and second choices lie
    within the two engines' activation rounding of each other, the continuations may part."""
    import subprocess

    agreement = importlib.util.spec_from_file_location(
        "gguf_agreement", Path(__file__).resolve().parents[1] / "benchmarks" / "gguf_agreement.py")
    module = importlib.util.module_from_spec(agreement)
    agreement.loader.exec_module(module)
    f16, q4 = tmp_path / "f16.gguf", tmp_path / "q4" / "q4_0.gguf"
    q4.parent.mkdir()
    export_gguf.export(hf_models["qwen2"][1], f16, "f16")
    subprocess.run([str(llama_cpp_bin() / "llama-quantize"), "--pure", str(f16), str(q4), "Q4_0"], check=True,
                   capture_output=True)
    prompts = [PROMPT, PROMPT[::-1], [p // 2 + 3 for p in PROMPT]]
    ours = module.anna_tokens(q4, prompts, 12, str(cache_dir))
    theirs = module.llama_tokens(str(llama_cpp_bin() / "llama-server"), q4, prompts, 12, 8097)
    compared = 0
    for (tokens, mine), (expected, top) in zip(ours, theirs):
        gap = module.gap(mine, top)
        if gap is None:  # llama-server sent no probabilities for this answer
            continue
        compared += 1
        assert gap < 0.05  # the same weights: log-probabilities apart by rounding only
        best = sorted(top.values(), reverse=True)
        if best[0] - best[1] > 2 * gap:
            assert tokens[0] == expected[0]
    assert compared >= 2


@pytest.fixture(scope="module")
def qwen3_5_wide_heads(tmp_path_factory):
    """A Qwen3.5 whose value heads span whole Q4_0 blocks (32 channels, as real ones do with 128):
    the tiled-to-grouped reorder of ssm_out's columns then moves whole blocks."""
    import transformers

    from conftest import COMMON, HYBRID

    cfg = transformers.Qwen3_5TextConfig(**{**COMMON, **HYBRID, "linear_value_head_dim": 32, "tie_word_embeddings": True})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    root = tmp_path_factory.mktemp("qwen3_5_wide")
    save_hf_model(model, root / "hf")
    out = root / "q4" / "q4_0.gguf"
    out.parent.mkdir()
    export_gguf.export(root / "hf", out, "q4_0")
    return out


def test_a_qwen3_5_q4_0_gguf_loads_its_blocks_as_they_are(qwen3_5_wide_heads, cache_dir, caplog):
    with caplog.at_level(logging.INFO):
        engine = gguf_engine(qwen3_5_wide_heads, cache_dir, disable_int4_cache=True, int4_matmul="dequant")
    assert engine.settings.quantization == "int4"
    assert any("GGUF Q4_0:" in r.message and "as it is stored" in r.message for r in caplog.records)
    floats = gguf_engine(qwen3_5_wide_heads, cache_dir, quantization="none")
    a, tokens = run_logits(engine, PROMPT, 4)
    b, _ = run_logits(floats, PROMPT, 4, forced=tokens)
    assert rel(a, b) < 1e-5  # the int4 layers hold exactly the file's values, reordered blocks and all
    out_proj, dense_out_proj = engine.runner.model.layers[0].linear_attn.out_proj, \
        floats.runner.model.layers[0].linear_attn.out_proj
    rows = torch.arange(dense_out_proj.out_features)
    assert torch.equal(out_proj.dequantized(), dense_out_proj.weight_rows(rows).float())


@pytest.mark.skipif(not __import__("os").environ.get("LLAMA_CPP_SRC"),
                    reason="needs a llama.cpp source tree (LLAMA_CPP_SRC) for its converter")
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5", "qwen3_5_moe"])  # (its Qwen2/Qwen3 path needs sentencepiece)
def test_export_matches_llama_cpps_converter(arch, hf_models, gguf_files, tmp_path):
    """benchmarks/export_gguf.py writes the tensors llama.cpp's convert_hf_to_gguf.py writes (to the
    last bit of float32 exp), so that the files the tests serve are laid out as users' are."""
    import os
    import subprocess
    import sys

    theirs = tmp_path / "llama_cpp.gguf"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "llamacpp_convert.py"
    subprocess.run([sys.executable, str(script), "--llama-cpp", os.environ["LLAMA_CPP_SRC"], "--model",
                    str(hf_models[arch][1]), "--out", str(theirs)], check=True, capture_output=True)
    from anna.weights.gguf_file import GGUFFile

    a, b = GGUFFile(theirs), GGUFFile(gguf_files[arch, "f16"])
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb)
    for name, t in ta.items():
        assert (t.type_name, t.shape) == (tb[name].type_name, tb[name].shape), name
        np.testing.assert_allclose(t.data.astype(np.float64), tb[name].data.astype(np.float64), rtol=1e-6, err_msg=name)
