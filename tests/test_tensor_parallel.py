"""Tensor parallelism on CPU: 2 ranks over gloo, one thread each (this machine has 2 cores).

The oracle is the same as everywhere: transformers' logits, and the same engine with one rank.
Ranks are real processes meeting through torch.distributed; a killed rank must end the engine
with an error that names it, within a bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from anna import LLM, SamplingParams
from anna.core.config import ServeSettings
from anna.core.errors import EngineDeadError
from anna.runtime.engine import LLMEngine
from conftest import build_hf_model, engine_settings, free_port, launch_server, save_hf_model
from helpers import assert_logits_close, hf_logits, run_logits

PROMPT = [(7 * i + 3) % 700 + 5 for i in range(37)]


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory):
    """A Llama with one KV head: fewer KV heads than ranks, so each rank keeps a copy of it."""
    model = build_hf_model("llama2_mha_tied", num_key_value_heads=1)
    return model, save_hf_model(model, tmp_path_factory.mktemp("mqa") / "llama_mqa")


def _engine(model_dir, cache_dir, tp: int, **overrides) -> LLMEngine:
    return LLMEngine(engine_settings(model_dir, cache_dir, tensor_parallel_size=tp, num_gpu_blocks_override=96,
                                     **overrides), show_progress=False)


def _logits_both(model_dir, cache_dir, **overrides):
    one = _engine(model_dir, cache_dir, 1, **overrides)
    logits_1, tokens_1 = run_logits(one, PROMPT, 6, chunks=[20, 17])
    two = _engine(model_dir, cache_dir, 2, **overrides)
    try:
        assert two.workers is not None and len(two.workers.procs) == 1
        logits_2, tokens_2 = run_logits(two, PROMPT, 6, chunks=[20, 17])
    finally:
        two.shutdown()
    return (logits_1, tokens_1), (logits_2, tokens_2)


@pytest.mark.parametrize("arch", ["qwen2", "mqa", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_two_ranks_match_one_rank_and_transformers(arch, hf_models, mqa_model, cache_dir):
    """qwen2: dense, tied embedding, q/k/v bias; mqa: 1 KV head over 2 ranks; qwen3_moe: experts
    split by columns; the hybrid family: Gated DeltaNet heads (and their conv channels and
    states) split by key head, gated attention's query gates with their heads, a shared expert;
    Qwen3-Next's projections fused per key head."""
    model, path = mqa_model if arch == "mqa" else hf_models[arch]
    (logits_1, tokens_1), (logits_2, tokens_2) = _logits_both(path, cache_dir)
    assert tokens_2 == tokens_1
    assert_logits_close(logits_2, logits_1, rel=1e-5)  # fp32: only the order of the sums differs
    ref = hf_logits(model, PROMPT + tokens_1[:-1])
    assert_logits_close(logits_2, ref, rel=1e-4)


@pytest.mark.parametrize("arch,overrides", [("qwen2", dict(quantization="int4")),
                                            ("qwen2", dict(quantization="int8")),
                                            ("qwen3", dict(dtype="bfloat16"))])
def test_two_ranks_quantized_and_bf16_match_one_rank(arch, overrides, hf_models, cache_dir):
    """Each rank quantizes its own rows and columns: int4/int8 groups of the row-parallel layers
    fall on the same input columns as on one rank. (The built-in routing on both: calibrated
    thresholds, timed per host key, could send a prefill chunk to another kernel on one side.)"""
    (logits_1, tokens_1), (logits_2, tokens_2) = _logits_both(hf_models[arch][1], cache_dir, calibrate=False,
                                                              **overrides)
    assert tokens_2 == tokens_1
    assert_logits_close(logits_2, logits_1, rel=2e-3)


def test_a_q4_0_gguf_keeps_its_blocks_on_each_rank(hf_models, cache_dir, tmp_path):
    """A GGUF's Q4_0 blocks split by rows and, in row-parallel layers, by whole groups of columns:
    the same tokens and logits as one rank serving the same file."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "export_gguf", Path(__file__).resolve().parents[1] / "benchmarks" / "export_gguf.py")
    export_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export_gguf)
    path = tmp_path / "qwen2-q4_0.gguf"
    export_gguf.export(hf_models["qwen2"][1], path, "q4_0")
    (logits_1, tokens_1), (logits_2, tokens_2) = _logits_both(path, cache_dir, calibrate=False)
    assert tokens_2 == tokens_1
    assert_logits_close(logits_2, logits_1, rel=1e-5)


def _requests():
    shared = [(11 * i + 1) % 600 + 10 for i in range(40)]  # 2 full blocks shared by three prompts
    prompts = [shared + [101, 102], shared + [201], shared + [301, 302, 303], list(range(50, 90)), [5, 6, 7], PROMPT]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 5, 9, 16, 3, 7)]
    params[3] = SamplingParams(max_tokens=16, temperature=0.8, seed=123, ignore_eos=True)  # seeded sampling
    return [{"prompt_token_ids": p} for p in prompts], params


@pytest.mark.parametrize("arch,speculative", [("qwen2", None),
                                              ("qwen2", '{"method": "ngram", "num_speculative_tokens": 3}'),
                                              ("qwen3_5", None)])
def test_continuous_batching_and_prefix_caching(arch, speculative, hf_models, cache_dir):
    """Six requests, four at a time, prefills in chunks of 16 beside decodes, a shared prefix found
    in the cache (the hybrid model: through its states saved at block boundaries): the same tokens
    as one rank, and every KV block back at the end."""
    prompts, params = _requests()
    kw = dict(dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512, log_level="warning",
              num_gpu_blocks_override=64, max_num_seqs=4, max_num_batched_tokens=24,
              long_prefill_token_threshold=16)
    if speculative:
        kw["speculative_config"] = speculative
    path = str(hf_models[arch][1])
    want = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params)]
    threads = torch.get_num_threads()
    llm = LLM(path, tensor_parallel_size=2, kv_release_chunk_blocks=16, **kw)
    assert torch.get_num_threads() == max(1, threads // 2)  # rank 0's share of the cores
    try:
        # as an idle server does: every rank commits fresh chunks ahead of use, layer by layer
        while llm.llm_engine.commit_idle_memory(0.0):
            pass
        assert llm.llm_engine.memory.ahead == {0, 1, 2, 3}
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        snap = llm.llm_engine.snapshot()
        assert got == want
        assert snap.prefix_cache_hits >= 32  # the two later prompts found the shared blocks
        assert snap.num_free_blocks == snap.num_blocks  # none leaked (cached ones are free)
        assert snap.num_running == snap.num_waiting == 0
        # every rank hands the idle blocks' memory back; the next requests recompute the same tokens
        assert llm.llm_engine.memory.release("test")["kv_chunks"] > 0
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    finally:
        llm.shutdown()
    assert torch.get_num_threads() == threads


def test_a_killed_rank_ends_the_engine_with_a_clear_error(hf_models, cache_dir):
    engine = _engine(hf_models["qwen2"][1], cache_dir, 2)
    try:
        assert run_logits(engine, PROMPT, 1)[1]  # it runs
        proc = engine.workers.procs[0]
        os.kill(proc.popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.workers.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            engine.check_ranks()  # what the server's idle loop checks
        result: dict = {}

        def step() -> None:
            try:
                engine.add_request("after", PROMPT, SamplingParams(max_tokens=2))
                while engine.has_unfinished_requests():
                    engine.step()
            except Exception as exc:  # the engine must raise, not hang
                result["error"] = exc

        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the engine hung on a dead rank"
        assert isinstance(result.get("error"), EngineDeadError) and "rank 1" in str(result["error"])
    finally:
        engine.shutdown()


def test_a_failure_of_rank_0_inside_a_forward_ends_the_engine(hf_models, cache_dir):
    """The other rank is left inside the forward's collectives; going on would pair every later
    collective with the wrong one, so the engine ends, and closing it does not wait on the rank."""
    engine = _engine(hf_models["qwen2"][1], cache_dir, 2)
    try:
        def fail(*args):
            raise RuntimeError("injected failure in rank 0's MLP")

        engine.runner.model.layers[1].mlp.forward = fail
        engine.add_request("r", PROMPT, SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError, match="out of step"):
            while engine.has_unfinished_requests():
                engine.step()
        start = time.monotonic()
    finally:
        engine.shutdown()
    assert time.monotonic() - start < 10
    assert engine.workers.procs[0].popen.returncode is not None


def test_two_nodes_on_one_host(hf_models, cache_dir, tmp_path):
    """Node 1 is `anna serve --node-rank 1` in a process of its own; node 0 runs the engine."""
    path = hf_models["qwen2"][1]
    port = free_port()
    node_flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    log = tmp_path / "node1.log"
    with open(log, "w") as fh:
        node1 = subprocess.Popen([sys.executable, "-m", "anna.cli.main", "serve", str(path), "--dtype", "float32",
                                  "--device", "cpu", "--cache-dir", str(cache_dir), "--max-model-len", "512",
                                  "--node-rank", "1", *node_flags], stdout=fh, stderr=subprocess.STDOUT)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        kw = dict(dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512, log_level="warning",
                  num_gpu_blocks_override=64)
        want = LLM(str(path), **kw).generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
        llm = LLM(str(path), tensor_parallel_size=2, nnodes=2, master_port=port, **kw)
        try:
            assert llm.llm_engine.workers.procs == []  # rank 1 is the other node's
            got = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
            assert got == want
        finally:
            llm.shutdown()
        assert node1.wait(timeout=30) == 0, log.read_text()
        assert "rank 1" in log.read_text()
    finally:
        if node1.poll() is None:
            node1.kill()


def test_ray_backend(hf_models, cache_dir):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'anna[ray]')")
    path = str(hf_models["qwen2"][1])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=512, log_level="warning",
              num_gpu_blocks_override=64)
    want = LLM(path, **kw).generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **kw)
        try:
            assert llm.llm_engine.workers.ray_workers is not None
            got = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
            assert got == want
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()


def test_server_with_two_ranks_answers_and_ends_when_a_rank_dies(hf_models, cache_dir, tmp_path):
    import httpx

    log = tmp_path / "server.log"
    proc, base = launch_server(hf_models["qwen2"][1], cache_dir, log, "--tensor-parallel-size", "2",
                               "--num-gpu-blocks-override", "64", "--no-inference-warmup", "--log-level", "info")
    try:
        r = httpx.post(base + "/v1/completions", json={"model": str(hf_models["qwen2"][1]), "prompt": "a b c",
                                                       "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        ranks = [pid for pid in _children(proc.pid) if "anna.parallel.rank_main" in _cmdline(pid)]
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        assert proc.wait(timeout=60) != 0  # the server ends instead of hanging
        text = log.read_text()
        assert "tensor-parallel rank 1" in text and "exited with code -9" in text
    finally:
        if proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.parametrize("overrides,field", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),  # 4 heads over 3 ranks
    (dict(tensor_parallel_size=2, nnodes=3), "tensor_parallel_size"),
    (dict(tensor_parallel_size=2, nnodes=2), "master_port"),
    (dict(tensor_parallel_size=2, node_rank=1, nnodes=2, master_port=29500), "node_rank"),
    (dict(tensor_parallel_size=2, prompt_cache_size=4), "prompt_cache_size"),
    (dict(tensor_parallel_size=2, decode_executor="graph"), "decode_executor"),
    (dict(tensor_parallel_size=2, speculative_config='{"method": "draft_model", "model": "/x", '
                                                     '"num_speculative_tokens": 2}'), "speculative_config"),
])
def test_what_cannot_be_split_is_refused_by_name(overrides, field, hf_models, cache_dir):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LLMEngine(engine_settings(hf_models["qwen2"][1], cache_dir, **overrides), show_progress=False)


def test_kv_heads_that_split_neither_way_are_refused(tmp_path, cache_dir):
    model = build_hf_model("qwen3", num_attention_heads=6, num_key_value_heads=3)
    path = save_hf_model(model, tmp_path / "kv3")
    with pytest.raises(ValueError, match="^tensor_parallel_size: .*3 KV heads"):
        LLMEngine(engine_settings(path, cache_dir, tensor_parallel_size=2), show_progress=False)


def test_an_mtp_head_is_refused(hf_models, cache_dir, tmp_path):
    import json
    import shutil

    path = tmp_path / "qwen3_5_mtp"
    shutil.copytree(hf_models["qwen3_5"][1], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="^tensor_parallel_size: .*multi-token-prediction head is not split"):
        LLMEngine(engine_settings(path, cache_dir, tensor_parallel_size=2,
                                  speculative_config='{"method": "mtp", "num_speculative_tokens": 1}'),
                  show_progress=False)


def test_launcher_variables_are_read_through_the_settings():
    env = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511", "GROUP_RANK": "1", "NNODES": "2"}
    s = ServeSettings(tensor_parallel_size=4).resolve(env=env)
    assert (s.master_addr, s.master_port, s.node_rank, s.nnodes) == ("10.1.2.3", 29511, 1, 2)
    assert s.sources["master_addr"] == "env MASTER_ADDR" and s.sources["node_rank"] == "env GROUP_RANK"
    s = ServeSettings().resolve(env={**env, "ANNA_MASTER_ADDR": "10.9.9.9", "ANNA_TP": "2"})
    assert (s.master_addr, s.tensor_parallel_size) == ("10.9.9.9", 2)  # Anna's own variable wins
    assert s.sections.parallel.master_port == 29511
