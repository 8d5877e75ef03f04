"""Tiny random-weight models built with transformers (the reference implementation) for every
architecture Anna supports, saved once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from anna.weights.demo_model import write_demo_tokenizer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines in tests keep the built-in routing thresholds, which the parity tests' prompt lengths are
# chosen around; tests/test_calibration.py turns the host's calibration on where it tests it.
os.environ.setdefault("ANNA_CALIBRATE", "0")

# Fuzzing (tests/test_fuzz.py): a bounded, reproducible sample by default; the full run with
# --hypothesis-profile=anna-fuzz-full
_FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
settings.register_profile("anna-ci", max_examples=12, **_FUZZ)
settings.register_profile("anna-fuzz-full", max_examples=1000, **_FUZZ)
settings.load_profile("anna-ci")
torch.set_num_threads(min(2, torch.get_num_threads()))

VOCAB = 800  # >= the demo tokenizer's vocabulary
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)

HYBRID = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)

ARCH_CONFIGS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0, tie_word_embeddings=False)),
    "llama2_mha_tied": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    # mixture of experts: 8 experts, 2 or 3 per token; Qwen2-MoE with a shared expert and a dense first layer
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                                            intermediate_size=64, tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        mlp_only_layers=[0], norm_topk_prob=False, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
        tie_word_embeddings=False)),
    # hybrid: Gated DeltaNet layers 0-2, gated full attention in layer 3; 2 key heads serve 4 value heads
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(HYBRID, tie_word_embeddings=True)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        HYBRID, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        tie_word_embeddings=False)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        HYBRID, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=False)),
}


def build_hf_model(name: str, seed: int = 0, **overrides):
    """``overrides``: config fields changed from ARCH_CONFIGS' (e.g. one KV head)."""
    import transformers

    config_cls, model_cls, extra = ARCH_CONFIGS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # larger-than-default weights so that logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:  # norm weights and biases: away from their trivial 1 / 0
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf_model(model, path: Path, **save_kwargs) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **save_kwargs)
    _, eos, _ = write_demo_tokenizer(path)
    gen = path / "generation_config.json"
    gen.write_text(f'{{"eos_token_id": {eos}}}')
    return path


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (transformers model, saved directory)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name in ARCH_CONFIGS:
        model = build_hf_model(name)
        out[name] = (model, save_hf_model(model, root / name))
    return out


@pytest.fixture(scope="session")
def qwen2_dir(hf_models) -> Path:
    return hf_models["qwen2"][1]


@pytest.fixture(scope="session")
def roomy_qwen2_dir(qwen2_dir, tmp_path_factory) -> Path:
    """The tiny Qwen2 with 16,384 positions instead of 512: room for a prompt that lists tools (the
    demo tokenizer spends a token on almost every character of JSON) or for a long generation."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("roomy") / "qwen2"
    shutil.copytree(qwen2_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
    return path


@pytest.fixture(scope="session")
def grammar_checker(qwen2_dir, cache_dir):
    """accepts(spec, text): whether the engine's grammar compiler takes ``text`` (tokenized by the
    tiny model's tokenizer) as a whole sentence of the constraint ``spec``."""
    from anna import LLM

    llm = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512,
              num_gpu_blocks_override=32)
    structured, tok = llm.llm_engine.structured, llm.get_tokenizer()

    def accepts(spec, text: str) -> bool:
        matcher = structured.new_matcher(spec)
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    return accepts


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("anna-cache")


def fresh_cache_dir(path: Path, cache_dir: Path) -> Path:
    """An empty Anna cache dir at ``path`` that shares the session's compiled kernels (its kernels/
    links to ``cache_dir``'s), so a test of what a first start creates does not rebuild them."""
    path.mkdir(parents=True, exist_ok=True)
    (cache_dir / "kernels").mkdir(exist_ok=True)
    (path / "kernels").symlink_to(cache_dir / "kernels", target_is_directory=True)
    return path


def kernels_at_level(level: str, cache_dir: Path):
    """Anna's CPU kernels built for one kernel level (kernels.LEVEL_CFLAGS); a level this CPU lacks
    is skipped, saying so."""
    from anna.platforms.cpu.isa import detect_isa
    from anna.platforms.cpu.kernels import build_cpu_kernels

    here = detect_isa()
    if not here.has(level):
        pytest.skip(f"kernel level {level}: this CPU ({here.model_name}) has instruction sets up to {here.available}")
    kernels = build_cpu_kernels(cache_dir, isa=detect_isa(force=level))
    assert kernels is not None and kernels.level == level, "this machine should build Anna's CPU kernels"
    return kernels


def engine_kernel_level():
    """The kernel level an engine started now runs (platforms/cpu/isa.py): the CPU's, or a lower one
    that ANNA_CPU_ISA forces, as the engine's settings resolve it."""
    from anna.core.config import ServeSettings
    from anna.platforms.cpu.isa import detect_isa

    return detect_isa(force=ServeSettings().resolve().cpu_isa)


def skip_without_cpu_kernels() -> None:
    """Skip, saying why, a test of Anna's CPU kernels where an engine would run none: a CPU without
    AVX2/FMA/F16C, or ANNA_CPU_ISA=none (torch's kernels only)."""
    isa = engine_kernel_level()
    if isa.level == "none":
        pytest.skip(f"Anna's CPU kernels: none at kernel level none ({isa.describe()})")


def amx_kernels(build: str, cache_dir: Path):
    """The amx level's kernels, ``native`` (an AMX CPU) or ``emulated`` (its tile instructions in
    C, csrc/amx_tiles.h, which runs on an AVX-512 VNNI CPU); skipped, saying why, where this CPU
    can run neither."""
    from anna.platforms.cpu.kernels import AMX_EMULATED_CFLAGS, load_kernels

    if build == "native":
        return kernels_at_level("amx", cache_dir)
    kernels_at_level("avx512_vnni", cache_dir)  # skips a CPU without it
    kernels = load_kernels(cache_dir, "", "amx", AMX_EMULATED_CFLAGS, name="amx_emulated")
    assert kernels is not None
    return kernels


def engine_settings(model_dir, cache_dir, **overrides):
    from anna.core.config import ServeSettings

    # env={} below: ANNA_CALIBRATE=0 does not reach these settings, so the built-in routing is set here
    base = dict(model=str(model_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir),
                num_gpu_blocks_override=256, max_model_len=512, log_level="warning", calibrate=False)
    base.update(overrides)
    return ServeSettings(**base).resolve(env={})


SERVER_API_KEY = "test-key-123"
SERVER_MODEL = "tiny-qwen2"
SERVER_MODEL_ALIAS = "qwen-alias"  # a second --served-model-name
LIVE_SERVER_ARGS = ("--served-model-name", SERVER_MODEL, SERVER_MODEL_ALIAS, "--api-key", SERVER_API_KEY,
                    "--num-gpu-blocks-override", "96", "--max-n", "4")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(model_dir, cache_dir, log_path, *extra: str, port: int | None = None):
    """Start `anna serve` on 127.0.0.1 and wait (bounded) until /health says ok; (process, base URL)."""
    import subprocess
    import sys
    import time

    import httpx

    port = port or free_port()
    cmd = [sys.executable, "-m", "anna.cli.main", "serve", str(model_dir), "--port", str(port), "--dtype", "float32",
           "--device", "cpu", "--max-model-len", "512", "--cache-dir", str(cache_dir), "--log-level", "warning",
           *extra]
    env = dict(os.environ, ANNA_API_KEY="")
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        assert proc.poll() is None, Path(log_path).read_text()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not become healthy:\n" + Path(log_path).read_text())


def stop_server(proc) -> int:
    import subprocess

    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture(scope="session")
def live_server(qwen2_dir, cache_dir, tmp_path_factory):
    """A real `anna serve` process on 127.0.0.1 with the tiny Qwen2 model and an API key."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, base = launch_server(qwen2_dir, cache_dir, log, *LIVE_SERVER_ARGS)
    yield base
    stop_server(proc)


def pytest_addoption(parser):
    parser.addoption("--console-screenshots", default=None, metavar="DIR",
                     help="Where the web console's browser test also saves its screenshots (docs/ keeps them).")
