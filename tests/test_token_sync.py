"""The token sync window: non-streaming requests read their tokens back every N steps. Outputs
must be identical to reading every step, whatever stops them and wherever in the window."""

from __future__ import annotations

import pytest

from anna import LLM, SamplingParams
from anna.core.request import PENDING_TOKEN

PROMPTS = [[(i * 31 + j * 7) % 700 + 3 for j in range(9 + 5 * i)] for i in range(4)]


def make(qwen2_dir, cache_dir, window: int, blocks: int = 128) -> LLM:
    return LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=256,
               num_gpu_blocks_override=blocks, scheduler_token_sync_every_steps=window)


@pytest.fixture(scope="module")
def every_step(qwen2_dir, cache_dir):
    llm = make(qwen2_dir, cache_dir, 1)
    assert llm.llm_engine.token_sync_every == 1
    return llm


@pytest.fixture(scope="module")
def windowed(qwen2_dir, cache_dir):
    return make(qwen2_dir, cache_dir, 8)


def run(llm: LLM, params) -> list[list[tuple[list[int], str, str | None]]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(o.token_ids, o.text, o.finish_reason) for o in out.outputs] for out in outs]


def test_auto_window_is_one_on_cpu(qwen2_dir, cache_dir):
    assert make(qwen2_dir, cache_dir, 0).llm_engine.token_sync_every == 1


def test_stop_tokens_inside_the_window_give_identical_outputs(every_step, windowed):
    free = run(every_step, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # a stop token the greedy outputs meet at different places in the window
    stops = [free[i][0][0][3 + i] for i in range(len(PROMPTS))]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stops)
    steps = every_step.llm_engine.stats.steps
    before = sum(steps.counts.values())
    expected = run(every_step, params)
    every_steps = sum(steps.counts.values()) - before
    assert any(len(o[0][0]) < 30 for o in expected)  # some really stopped early
    engine = windowed.llm_engine
    before, tokens_before = sum(engine.stats.steps.counts.values()), engine.stats.generation_tokens
    assert run(windowed, params) == expected
    # the window ran steps past the stops, then dropped what they produced
    assert sum(engine.stats.steps.counts.values()) - before > every_steps
    assert engine.stats.generation_tokens - tokens_before == sum(len(o[0][0]) for o in expected)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_sampled_and_n_and_length_are_identical(every_step, windowed):
    for params in (SamplingParams(temperature=1.0, seed=5, max_tokens=21, ignore_eos=True),
                   SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=9, max_tokens=13),
                   SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=40, min_tokens=10)):
        assert run(windowed, params) == run(every_step, params)


def test_requests_that_need_each_token_are_not_windowed(windowed):
    engine = windowed.llm_engine
    for params in (SamplingParams(stop=["x"]), SamplingParams(logprobs=2), SamplingParams(repetition_penalty=1.2),
                   SamplingParams(presence_penalty=0.5), SamplingParams(output_kind="cumulative")):
        assert engine.inputs.sync_window(params) == 1
    assert engine.inputs.sync_window(SamplingParams(output_kind="final_only", logit_bias={5: 1.0})) == 8


def test_pending_tokens_survive_preemption(qwen2_dir, cache_dir, every_step):
    """A pool too small for every request: preempted requests are recomputed with tokens that
    were still on the device."""
    small = make(qwen2_dir, cache_dir, 8, blocks=16)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    got = run(small, params)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert got == run(every_step, params)
    assert all(PENDING_TOKEN not in o[0][0] for o in got)


def test_windowed_and_streamed_requests_share_a_batch(windowed, every_step):
    """A cumulative (streamed) request next to windowed ones reads its tokens every step."""
    engine = windowed.llm_engine
    cumulative = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind="cumulative")
    final = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind="final_only")
    engine.add_request("streamed", PROMPTS[0], cumulative)
    engine.add_request("final", PROMPTS[1], final)
    seen: dict[str, list] = {"streamed": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out.outputs[0].token_ids)
    assert len(seen["streamed"]) == 12 and len(seen["final"]) == 1  # final_only: one output
    ref = run(every_step, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert seen["streamed"][-1] == ref[0][0][0] and seen["final"][0] == ref[1][0][0]


def test_windowed_n_equal_prompts_and_preemption_match_every_step(qwen2_dir, cache_dir, every_step):
    """Two equal prompts, n=2 with seeds and a pool small enough to preempt: blocks that fill while
    their tokens are still on the device must not be hashed with placeholders (a re-admitted
    sequence would then find another sequence's KV under the same placeholder hash)."""
    small = make(qwen2_dir, cache_dir, 8, blocks=16)
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=60, ignore_eos=True)
    got = [[(o.token_ids, o.text) for o in out.outputs] for out in small.generate(prompts, params, use_tqdm=False)]
    want = [[(o.token_ids, o.text) for o in out.outputs]
            for out in every_step.generate(prompts, params, use_tqdm=False)]
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert got == want
    kv = small.llm_engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.req_hashes and not kv.req_blocks  # nothing kept per request once it is done


@pytest.mark.parametrize("max_tokens", [12, 13, 14, 30])  # the last block one short, full, one over, several
def test_windowed_generated_blocks_are_found_by_the_next_turn(qwen2_dir, cache_dir, every_step, max_tokens):
    windowed = make(qwen2_dir, cache_dir, 8)
    engine = windowed.llm_engine
    prompt = PROMPTS[2]  # 19 tokens: blocks fill in the middle of a sync window
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = windowed.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == every_step.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    conversation = prompt + first  # every token but the last had its KV computed
    bs = engine.kv.block_size
    hits_before = engine.kv.prefix_cache_hits
    second = windowed.generate([conversation + [5, 6, 7]], SamplingParams(temperature=0, max_tokens=2),
                               use_tqdm=False)[0]
    assert second.num_cached_tokens == (len(conversation) - 1) // bs * bs
    assert engine.kv.prefix_cache_hits - hits_before == second.num_cached_tokens
