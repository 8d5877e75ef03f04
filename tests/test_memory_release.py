"""Adaptive memory release: an idle engine shrinks back, blocks in use are never touched, and
outputs after a release are the same."""

from __future__ import annotations

import pytest
import torch

from anna.core.sampling_params import SamplingParams
from anna.runtime.engine import LLMEngine
from conftest import engine_settings
from test_scheduler import assert_pool_free, drain


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def make(qwen2_dir, cache_dir, **kw) -> LLMEngine:
    base = dict(num_gpu_blocks_override=4096, max_model_len=512, kv_release_chunk_blocks=16, max_num_seqs=32,
                max_num_batched_tokens=2048, memory_release_sweep_interval_s=0)
    base.update(kw)
    return LLMEngine(engine_settings(qwen2_dir, cache_dir, **base), show_progress=False)


def test_pool_commits_memory_only_as_it_is_used(qwen2_dir, cache_dir):
    make(qwen2_dir, cache_dir)  # compile kernels, import everything first
    before = rss_bytes()
    engine = make(qwen2_dir, cache_dir, num_gpu_blocks_override=32768)
    pool = engine.kv.num_blocks * engine.memory.block_bytes
    assert pool >= 256 * 2**20
    assert rss_bytes() - before < 0.1 * pool  # reserved, not taken
    assert engine.memory.resident_bytes() == 0


def test_idle_engine_after_a_burst_shrinks_back(qwen2_dir, cache_dir):
    # free memory is always "below" a huge floor: every time the engine goes idle it releases at once
    engine = make(qwen2_dir, cache_dir, min_free_memory_mib=10**9, enable_prefix_caching=True)
    per_block = engine.memory.block_bytes
    burst = [(f"b{i}", [3 + (i * 7 + j) % 700 for j in range(480)], SamplingParams(max_tokens=30, ignore_eos=True))
             for i in range(32)]
    kv_bytes = 32 * 30 * per_block  # 30 blocks of 16 tokens per request
    before = rss_bytes()
    engine.memory.policy.min_free_mib = 0  # let the burst build up first
    for rid, prompt, params in burst:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.running and len(engine.scheduler.running) == 32 and not engine.scheduler.waiting:
            break
    assert engine.memory.resident_bytes() >= 0.9 * kv_bytes
    grown = rss_bytes()
    assert grown - before > 0.7 * kv_bytes  # the pool commits memory only as blocks are used
    engine.memory.policy.min_free_mib = 10**9
    drain(engine)  # the last request to end triggers the release
    assert engine.memory.releases == 1 and engine.memory.resident_bytes() == 0
    assert not engine.kv.pool.cached  # cached prefix blocks in released chunks were evicted
    assert grown - rss_bytes() > 0.7 * kv_bytes  # and the pages really went back
    assert_pool_free(engine)


def test_release_never_touches_blocks_in_use_and_outputs_are_identical(qwen2_dir, cache_dir):
    prompt = [5 + (i * 11) % 600 for i in range(300)]  # 19 blocks
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = make(qwen2_dir, cache_dir)
    reference.add_request("r", prompt, params)
    expected = drain(reference)["r"]

    engine = make(qwen2_dir, cache_dir)
    engine.add_request("other", [7] * 400, SamplingParams(max_tokens=1, ignore_eos=True))
    drain(engine)  # leaves idle, cached blocks behind
    engine.add_request("r", prompt, params)
    for _ in range(5):
        engine.step()
    req = engine.outputs.seqs["r"][1].req
    in_use = {b.block_id // engine.memory.chunk_blocks for b in engine.kv.req_blocks["r"]}
    freed = engine.memory.release("test")
    assert freed["kv_chunks"] > 0
    assert in_use <= engine.memory.resident  # chunks holding blocks in use stay
    assert all(b.ref_cnt == 1 for b in engine.kv.req_blocks["r"])
    assert drain(engine)["r"] == expected
    assert req.num_output_tokens == 40
    # and a prompt whose cached blocks were evicted computes the same again
    engine.memory.release("test")
    hits = engine.kv.prefix_cache_hits
    engine.add_request("again", prompt, params)
    assert drain(engine)["again"] == expected
    assert engine.kv.prefix_cache_hits == hits  # nothing left to hit
    assert_pool_free(engine)


def test_periodic_sweep_releases_an_idle_gap(qwen2_dir, cache_dir):
    engine = make(qwen2_dir, cache_dir, memory_release_sweep_interval_s=30, memory_release_max_gap_mib=0.1,
                  min_free_memory_mib=0)
    engine.add_request("a", [9] * 400, SamplingParams(max_tokens=1, ignore_eos=True))
    drain(engine)
    assert engine.memory.releases == 0 and engine.memory.idle_gap_bytes() > 0.1 * 2**20
    assert engine.memory.maybe_release(idle=True, periodic=True) is None  # the interval has not passed
    engine.memory.last_sweep -= 31
    assert engine.memory.maybe_release(idle=False, periodic=True) is None  # never while busy
    freed = engine.memory.maybe_release(idle=True, periodic=True)
    assert freed is not None and freed["kv_chunks"] > 0 and engine.memory.idle_gap_bytes() == 0


@pytest.mark.parametrize("bad", [{"memory_release_max_gap_mib": -1}, {"kv_release_chunk_blocks": -5}])
def test_bad_release_settings_are_rejected(qwen2_dir, cache_dir, bad):
    with pytest.raises(ValueError):
        make(qwen2_dir, cache_dir, **bad)


def commit_all(engine: LLMEngine) -> int:
    """Run commit-ahead with no time to spare until it has nothing left to do, as the server's idle
    loop does; returns how many calls had more to do (with no time, one layer's K and V each)."""
    calls = 0
    while engine.commit_idle_memory(0.0):
        calls += 1
    return calls


def test_idle_engine_commits_fresh_kv_ahead_of_use(qwen2_dir, cache_dir):
    """An idle engine writes fresh chunks, lowest first, up to kv_commit_ahead_mib: RAM really goes up
    by that much, one layer per call when the time slice is spent, and a request's blocks then come from
    the committed chunks, after which the engine commits more to keep the margin."""
    make(qwen2_dir, cache_dir)  # compile kernels, import everything first
    engine = make(qwen2_dir, cache_dir, kv_commit_ahead_mib=0)
    assert not engine.commit_idle_memory(1.0) and engine.memory.resident_bytes() == 0  # off

    engine = make(qwen2_dir, cache_dir, kv_commit_ahead_mib=4)
    memory = engine.memory
    chunk_bytes = memory.chunk_blocks * memory.block_bytes
    ahead = int(4 * 2**20 // chunk_bytes)
    assert ahead >= 2
    before = rss_bytes()
    layers = len(memory.kv_caches)
    assert commit_all(engine) == ahead * layers  # a zero time slice: one layer's K and V per call
    assert memory.ahead == memory.resident == set(range(ahead))
    assert rss_bytes() - before > 0.8 * ahead * chunk_bytes  # the pages are really committed
    assert not engine.commit_idle_memory(1.0)  # the margin is there: nothing more to do

    engine.add_request("r", [5] * 100, SamplingParams(max_tokens=2, ignore_eos=True))  # 7 blocks, in chunk 0
    engine.step()
    assert 0 not in memory.ahead and memory.resident == set(range(ahead))
    commit_all(engine)
    assert memory.ahead == set(range(1, ahead + 1))  # one more chunk keeps the margin
    drain(engine)
    assert_pool_free(engine)


def test_commit_ahead_never_writes_blocks_in_use_nor_undoes_a_release(qwen2_dir, cache_dir):
    """A chunk that a request starts using while it is half committed is left alone, committing
    between steps leaves the request's blocks as they are and its output the same, and chunks a
    release returned are not committed again."""
    prompt = [5 + (i * 11) % 600 for i in range(300)]  # 19 blocks: chunks 0 and 1
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = make(qwen2_dir, cache_dir)
    reference.add_request("r", prompt, params)
    expected = drain(reference)["r"]

    engine = make(qwen2_dir, cache_dir, kv_commit_ahead_mib=4)  # 32 of the 256 chunks
    memory = engine.memory
    assert engine.commit_idle_memory(0.0)  # chunk 0's first layer, then the time slice is spent
    assert memory.partial == (0, 1)
    engine.add_request("r", prompt, params)
    engine.step()  # the prompt's blocks come from chunks 0 and 1
    assert memory.partial is None and {0, 1} <= memory.resident and not memory.ahead
    in_use = slice(0, 2 * memory.chunk_blocks)
    k, v = memory.kv_caches[-1]
    k_before, v_before = k[in_use].clone(), v[in_use].clone()
    assert k_before.abs().sum() > 0  # the request's K of the last layer, which commit-ahead never reached
    commit_all(engine)
    assert memory.ahead and min(memory.ahead) >= 2
    assert torch.equal(k[in_use], k_before) and torch.equal(v[in_use], v_before)
    assert drain(engine)["r"] == expected

    committed = set(memory.ahead)
    memory.policy.min_free_mib = 0
    assert memory.release("test")["kv_chunks"] > 0 and not memory.resident and not memory.ahead
    commit_all(engine)
    assert memory.ahead and min(memory.ahead) > max(committed)  # released chunks stay released
    engine.add_request("again", prompt, params)
    assert drain(engine)["again"] == expected
    assert_pool_free(engine)


def test_blocks_of_a_reset_prefix_cache_are_reused_before_fresh_memory(qwen2_dir, cache_dir):
    """Blocks whose cached prefixes a reset forgot (warmup ends with one) have been written, so the
    next requests get them before never-used blocks, whose first write is a page fault: RAM and the
    resident chunks stay where the first request left them."""
    engine = make(qwen2_dir, cache_dir, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("first", [3 + i % 600 for i in range(240)], params)  # 16 blocks: chunk 0
    drain(engine)
    first = set(engine.memory.resident)
    assert first == {0} and engine.kv.pool.cached
    engine.reset_after_warmup()
    assert not engine.kv.pool.cached
    engine.add_request("second", [7 + (i * 13) % 600 for i in range(240)], params)
    engine.step()
    assert set(engine.kv.block_ids("second")) <= set(range(engine.memory.chunk_blocks))
    drain(engine)
    assert engine.memory.resident == first
    assert_pool_free(engine)
