"""The graph decode executor's padded steps (platforms/cuda/graphs.py). Capture needs CUDA
(tests/test_cuda.py); here the same padded shapes and buffers run eagerly on CPU against the
eager path: same logits, and padded rows write nowhere but the spare KV block."""

from __future__ import annotations

import pytest
import torch

from anna import SamplingParams
from anna.core.request import Request
from anna.model.attention import read_slots
from anna.platforms.cuda.graphs import GraphDecoder, batch_sizes, padded_batch, padded_blocks
from anna.runtime.engine import LLMEngine
from anna.runtime.model_runner import ModelRunner
from conftest import engine_settings

PROMPT = [(i * 37 + 11) % 700 + 3 for i in range(60)]


def test_capture_sizes_and_padding():
    assert batch_sizes(1) == [1]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = batch_sizes(20)
    assert [padded_batch(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert [padded_blocks(n, 32) for n in (1, 2, 3, 4, 5, 17, 32)] == [1, 2, 4, 4, 8, 32, 32]
    assert padded_blocks(20, 24) == 24  # never past max_model_len's blocks


def padded_runner(engine: LLMEngine) -> ModelRunner:
    """A runner beside the engine's, sharing its model and block manager, with graph decode on
    (no capture on CPU) and zeroed caches, so that any write shows."""
    model = engine.runner.model
    graphs = GraphDecoder(model.forward, block_size=engine.kv.block_size, max_num_seqs=8,
                          max_model_len=engine.max_model_len, device=engine.device, capture=False)
    runner = ModelRunner(model, engine.runner.caches, engine.platform, engine.runner.specs, engine.runner.sampler,
                         decode_executor=graphs)
    assert runner.kv_caches[0][0].shape[0] == engine.kv.num_blocks + 1  # the spare block
    for k_cache, v_cache in runner.kv_caches:
        k_cache.zero_()
        v_cache.zero_()
    return runner


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch_attention", "anna_attention"])
def test_padded_decode_steps_match_eager_and_write_only_the_spare_block(cpu_kernels, hf_models, cache_dir):
    """torch_attention is the path CUDA runs: the padded positions are masked out. Anna's CPU decode
    attention reads context lengths instead."""
    _, path = hf_models["qwen2"]
    engine = LLMEngine(engine_settings(path, cache_dir, decode_executor="eager", max_num_seqs=8,
                                       cpu_kernels=cpu_kernels), show_progress=False)
    eager, kv = engine.runner, engine.kv
    padded = padded_runner(engine)
    spare = kv.num_blocks

    # 3 sequences of 1, 2 and 3-4 blocks (block size 16) decode together: batch 3 pads to 4 and
    # 3 blocks of table to 4; then the shortest stops (batch 2, no batch padding).
    params = SamplingParams(max_tokens=12, temperature=0.0)
    reqs = [Request(f"r{i}", PROMPT[:n], params) for i, n in enumerate((9, 21, 40))]
    tokens = {r.request_id: [] for r in reqs}
    try:
        for req in reqs:
            assert kv.allocate_slots(req, req.num_tokens)
            logits = [r.model.compute_logits(r.forward(r.prepare([req], [req.num_tokens])))
                      for r in (eager, padded)]
            torch.testing.assert_close(logits[1], logits[0])
            req.num_computed_tokens = req.num_tokens
            req.append_output_token(int(logits[0][-1].argmax()))
        steps = 0
        for step in range(10):
            batch = reqs if step < 4 else reqs[1:]
            for req in batch:
                assert kv.allocate_slots(req, 1)
            hidden = []
            for runner in (eager, padded):
                with torch.inference_mode():
                    hidden.append(runner.forward(runner.prepare(batch, [1] * len(batch))))
            logits = [eager.model.compute_logits(h) for h in hidden]
            torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
            steps += 1
            for row, req in enumerate(batch):
                req.num_computed_tokens += 1
                token = int(logits[0][row].argmax())
                assert int(logits[1][row].argmax()) == token
                req.append_output_token(token)
                tokens[req.request_id].append(token)
        assert padded.decode_executor.replays == steps

        # every request's KV is the eager runner's; no other block was written but the spare one
        owned = set()
        for req in reqs:
            ids = kv.block_ids(req.request_id)
            owned.update(ids)
            slots = torch.tensor([ids[p // 16] * 16 + p % 16 for p in range(req.num_computed_tokens)])
            for (ek, ev), (pk, pv) in zip(eager.kv_caches, padded.kv_caches):
                torch.testing.assert_close(read_slots(pk, slots), read_slots(ek, slots), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(read_slots(pv, slots), read_slots(ev, slots), rtol=1e-5, atol=1e-5)
        others = torch.tensor([b for b in range(spare) if b not in owned])
        for k_cache, v_cache in padded.kv_caches:
            assert k_cache[others].abs().sum() == 0 and v_cache[others].abs().sum() == 0
            assert k_cache[spare].abs().sum() > 0  # the padded rows' writes went here
    finally:
        for req in reqs:
            kv.free(req)


def test_graph_warm_up_runs_every_block_count_and_writes_only_the_spare_block(hf_models, cache_dir):
    _, path = hf_models["qwen2"]
    engine = LLMEngine(engine_settings(path, cache_dir, decode_executor="eager", max_num_seqs=8, cpu_kernels=False,
                                       max_model_len=384), show_progress=False)
    runner = padded_runner(engine)
    graphs = runner.decode_executor
    assert graphs.max_blocks == 24
    # batch 1 and 3 (padded to 4), each at 1, 2, 4, 8, 16 and 24 blocks
    assert graphs.warm_up([1, 3]) == 12
    spare = engine.kv.num_blocks
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache[:spare].abs().sum() == 0 and v_cache[:spare].abs().sum() == 0
        assert torch.isfinite(k_cache[spare]).all() and k_cache[spare].abs().sum() > 0
