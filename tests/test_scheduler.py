"""Continuous batching: batched, chunked, cached and preempted runs give the outputs of running
each request alone, and every KV block comes back."""

from __future__ import annotations

import random

import pytest

from anna.core.sampling_params import SamplingParams
from anna.runtime.engine import LLMEngine
from conftest import engine_settings
from helpers import record_batches


def make_engine(path, cache_dir, **kw) -> LLMEngine:
    return LLMEngine(engine_settings(path, cache_dir, **kw), show_progress=False)


def drain(engine: LLMEngine, add_at: dict[int, list[tuple]] | None = None, max_steps: int = 10_000) -> dict:
    """Step until idle; ``add_at[step]`` lists (id, prompt, params) to add before that step."""
    add_at = dict(add_at or {})
    results = {}
    step = 0
    while engine.has_unfinished_requests() or add_at:
        for rid, prompt, params in add_at.pop(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < max_steps, "engine did not finish"
    return results


def workload(n=16, seed=0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, 700) for _ in range(rng.randrange(3, 70))]
        reqs.append((f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), ignore_eos=True)))
    return reqs


def assert_pool_free(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture(scope="module")
def reference(qwen2_dir, cache_dir):
    """Each request of the workload run alone, no prefix caching."""
    engine = make_engine(qwen2_dir, cache_dir, enable_prefix_caching=False)
    ref = {}
    for rid, prompt, params in workload():
        engine.add_request(rid, prompt, params)
        ref.update(drain(engine))
    return ref


def test_batched_together_equals_alone(qwen2_dir, cache_dir, reference):
    engine = make_engine(qwen2_dir, cache_dir, max_num_seqs=16)
    assert drain(engine, {0: workload()}) == reference
    assert_pool_free(engine)


def test_staggered_arrivals_equal_alone(qwen2_dir, cache_dir, reference):
    engine = make_engine(qwen2_dir, cache_dir, max_num_seqs=6)
    reqs = workload()
    add_at = {i * 3: [r] for i, r in enumerate(reqs)}  # new requests join while others decode
    assert drain(engine, add_at) == reference
    assert_pool_free(engine)


def test_tiny_token_budget_forces_chunked_prefill(qwen2_dir, cache_dir, reference):
    engine = make_engine(qwen2_dir, cache_dir, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    batches = record_batches(engine)
    assert drain(engine, {0: workload()}) == reference
    assert all(sum(b) <= 8 for b in batches)
    chunks = [n for b in batches for n in b if n > 1]
    assert chunks and max(chunks) <= 8
    assert_pool_free(engine)


def test_interactive_profile_equal_outputs(qwen2_dir, cache_dir, reference):
    engine = make_engine(qwen2_dir, cache_dir, scheduler_profile="interactive", max_num_batched_tokens=32)
    assert engine.settings.sources["prefill_interval_steps"] == "profile"
    assert engine.scheduler.config.prefill_interval_steps == 1
    assert drain(engine, {0: workload()}) == reference


def test_prefill_interval_delays_admission(qwen2_dir, cache_dir):
    engine = make_engine(qwen2_dir, cache_dir, prefill_interval_steps=3,
                         scheduler_event_driven_prefill_insert=False)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", list(range(3, 20)), params)
    engine.step()  # a is admitted at once: nothing was running
    engine.add_request("b", list(range(3, 20)), params)
    admitted_at = None
    for step in range(1, 6):
        engine.step()
        if admitted_at is None and engine.scheduler.running and len(engine.scheduler.running) == 2:
            admitted_at = step
    assert admitted_at == 4  # three pure decode steps pass, the fourth admits b
    drain(engine)
    assert_pool_free(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "turboquant4"])  # blocks keep their scales
def test_prefix_cache_hits_are_exact_and_outputs_unchanged(qwen2_dir, cache_dir, kv_cache_dtype):
    prefix = list(range(100, 140))  # 40 tokens: two full 16-token blocks
    prompts = [prefix + [5, 6, 7], prefix + [8, 9], prefix[:20] + [10]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        engine = make_engine(qwen2_dir, cache_dir, enable_prefix_caching=caching, kv_cache_dtype=kv_cache_dtype)
        res = {}
        hits = []
        for i, p in enumerate(prompts):
            before = engine.kv.prefix_cache_hits
            engine.add_request(f"p{i}", p, params)
            res.update(drain(engine))
            hits.append(engine.kv.prefix_cache_hits - before)
        outs[caching] = res
        if caching:
            assert hits == [0, 32, 16]
            assert engine.kv.prefix_cache_queries == sum(len(p) for p in prompts)
        else:
            assert hits == [0, 0, 0] and engine.kv.prefix_cache_queries == 0
        assert_pool_free(engine)
    assert outs[True] == outs[False]


def test_whole_prompt_cached_still_computes_last_token(qwen2_dir, cache_dir):
    engine = make_engine(qwen2_dir, cache_dir)
    prompt = list(range(200, 232))  # exactly two blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", prompt, params)
    first = drain(engine)["a"]
    engine.add_request("b", prompt, params)
    out = drain(engine)
    assert out["b"] == first
    # the second block holds the last prompt token, so only the first can be reused
    assert engine.kv.prefix_cache_hits == 16


def test_cached_blocks_are_evicted_under_a_small_pool(qwen2_dir, cache_dir):
    engine = make_engine(qwen2_dir, cache_dir, num_gpu_blocks_override=8, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    shared = list(range(300, 340))
    engine.add_request("a", shared, params)
    drain(engine)
    for i in range(3):  # unrelated prompts that need the space
        engine.add_request(f"x{i}", [400 + i] * 100, params)
        drain(engine)
    before = engine.kv.prefix_cache_hits
    engine.add_request("again", shared, params)
    drain(engine)
    assert engine.kv.prefix_cache_hits == before  # the shared blocks were evicted (LRU)
    assert_pool_free(engine)


def test_small_pool_forces_preemption_with_identical_outputs(qwen2_dir, cache_dir, reference):
    engine = make_engine(qwen2_dir, cache_dir, num_gpu_blocks_override=12, max_model_len=96, max_num_seqs=16)
    assert drain(engine, {0: workload()}) == reference
    assert engine.scheduler.num_preemptions > 0
    assert_pool_free(engine)


def test_impossible_request_is_rejected_up_front(qwen2_dir, cache_dir):
    engine = make_engine(qwen2_dir, cache_dir, num_gpu_blocks_override=8, max_model_len=128)
    with pytest.raises(ValueError, match="^max_tokens: the prompt has 40 tokens and max_tokens is 100, 140 in all, "
                                         "more than max_model_len=128"):
        engine.add_request("big", list(range(3, 43)), SamplingParams(max_tokens=100))
    engine.add_request("fits", list(range(3, 43)), SamplingParams(max_tokens=88, ignore_eos=True))
    assert len(drain(engine)["fits"]) == 88  # exactly the whole pool
    assert not engine.has_unfinished_requests()
    assert_pool_free(engine)


@pytest.mark.parametrize("phase", ["waiting", "mid_prefill", "mid_decode", "finished"])
def test_abort_in_every_phase_frees_every_block(qwen2_dir, cache_dir, phase):
    engine = make_engine(qwen2_dir, cache_dir, max_num_batched_tokens=16, long_prefill_token_threshold=16,
                         max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("keep", list(range(3, 23)), params)
    engine.add_request("victim", list(range(50, 100)), params)
    if phase == "waiting":
        engine.step()  # max_num_seqs=1 keeps the victim waiting
        assert engine.scheduler.waiting
    else:
        drain_until = {"mid_prefill": lambda r: 0 < r.num_computed_tokens < r.num_prompt_tokens,
                       "mid_decode": lambda r: r.num_output_tokens >= 2,
                       "finished": lambda r: r.is_finished}[phase]
        victim = engine.outputs.seqs["victim"][1].req
        for _ in range(100):
            engine.step()
            if drain_until(victim):
                break
        assert drain_until(victim)
    engine.abort_request("victim")
    drain(engine)
    assert_pool_free(engine)


def test_exact_prompt_cache_hits_and_outputs_unchanged(qwen2_dir, cache_dir):
    prompts = [list(range(100, 140)), list(range(100, 141)), list(range(200, 230)), list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = make_engine(qwen2_dir, cache_dir, enable_prefix_caching=False)
    engine = make_engine(qwen2_dir, cache_dir, prompt_cache_size=2, prompt_cache_max_tokens=64)
    assert engine.prompt_cache.size == 2 and engine.prompt_cache.max_tokens == 64
    for i, p in enumerate(prompts):
        reference.add_request(f"q{i}", p, params)
        engine.add_request(f"q{i}", p, params)
    ref = drain(reference)
    assert drain(engine) == ref  # q3 repeats q0 exactly but is submitted together: no hit yet
    engine.add_request("again", prompts[0], params)
    reference.add_request("again", prompts[0], params)
    assert drain(engine)["again"] == drain(reference)["again"]
    # lookups: 4 + 1; hits: only "again". The LRU keeps 2 prompts: q2 evicted q0, then q3 (= q0) put it back.
    assert (engine.prompt_cache.lookups, engine.prompt_cache.hits) == (5, 1)
    assert engine.kv.prefix_cache_queries == 0  # no double residency: covered prompts skip the prefix cache
    assert len(engine.prompt_cache.entries) == 2
    assert_pool_free(engine)


def test_prompt_cache_auto_resolution(qwen2_dir, cache_dir):
    engine = make_engine(qwen2_dir, cache_dir)
    assert engine.prompt_cache.size == 0 and not engine.prompt_cache.enabled  # paged KV: off by default
    engine = make_engine(qwen2_dir, cache_dir, prompt_cache_size=3)
    assert engine.prompt_cache.max_tokens == 0  # explicitly on: no length limit unless asked
    long_prompt = list(range(3, 103))
    engine.add_request("x", long_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("y", long_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    drain(engine)
    assert engine.prompt_cache.hits == 0 and tuple(long_prompt) in engine.prompt_cache.entries


def test_requests_compare_by_identity():
    """The scheduler looks requests up in its queues: equal fields must not make two requests one
    (nor cost a field-by-field comparison per lookup)."""
    from anna.core.request import Request
    a, b = (Request("same", [1, 2, 3], SamplingParams()) for _ in range(2))
    assert a != b and a == a and len({a, b}) == 2
    assert [a].count(b) == 0
