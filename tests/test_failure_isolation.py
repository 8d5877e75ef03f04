"""One request must never stop the engine: a request that fails while it runs ends alone with an
error, the requests beside it finish with the tokens they get without it, and every KV block
comes back. A step that fails as a whole fails its requests only; an engine that cannot run any
more says so instead of failing requests forever."""

from __future__ import annotations

import asyncio

import pytest

from anna import LLM
from anna.core.errors import EngineDeadError, RequestError
from anna.core.sampling_params import SamplingParams
from anna.runtime.engine import LLMEngine
from anna.server.async_engine import AsyncEngine
from conftest import engine_settings

MARKER = 777  # a token id only the request that makes the forward pass fail contains


def make_engine(path, cache_dir, **kw) -> LLMEngine:
    return LLMEngine(engine_settings(path, cache_dir, **kw), show_progress=False)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Add all, step until idle; request id -> its final RequestOutput."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return done


def assert_idle(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    assert not engine.groups and not engine.scheduler.running and not engine.scheduler.waiting


def neighbours() -> list[tuple[str, list[int], SamplingParams]]:
    """A greedy and a seeded sampling request that run beside the bad one."""
    return [("greedy", list(range(5, 45)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
            ("seeded", [9, 8, 7, 6, 5], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12,
                                                       ignore_eos=True))]


def tokens(outputs: dict) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in outputs.items() if out.error is None}


@pytest.fixture(scope="module")
def engine(qwen2_dir, cache_dir):
    return make_engine(qwen2_dir, cache_dir)


@pytest.fixture(scope="module")
def alone(engine) -> dict[str, list[int]]:
    return tokens(run(engine, neighbours()))


def bans_that_empty_the_second_step(engine: LLMEngine) -> SamplingParams:
    """allowed_token_ids {a, b} with bad_words "a" and "bb": the first token must be b, after which
    both are banned, so the second step has nothing to sample (known only while it runs)."""
    tok = engine.tokenizer
    for x, y in (("a", "b"), ("c", "f"), ("b", "c")):
        a, bb = tok.encode(x, add_special_tokens=False), tok.encode(y * 2, add_special_tokens=False)
        if len(a) == 1 and len(bb) == 2 and bb[0] == bb[1] != a[0]:
            return SamplingParams(temperature=1.0, max_tokens=8, allowed_token_ids=[a[0], bb[0]],
                                  bad_words=[x, y * 2], ignore_eos=True)
    raise AssertionError("no letters of the test tokenizer tokenize as needed")


def test_a_request_whose_bans_empty_a_step_fails_alone_with_a_400(engine, alone):
    bad = bans_that_empty_the_second_step(engine)
    out = run(engine, neighbours() + [("bad", [3, 4, 5], bad)])
    error = out["bad"].error
    assert isinstance(error, RequestError) and error.status == 400 and error.param == "allowed_token_ids"
    assert "bad_words" in error.message and out["bad"].outputs[0].finish_reason == "error"
    assert tokens(out) == alone  # the neighbours got exactly the tokens they get without it
    assert engine.stats.failed[400] >= 1
    assert_idle(engine)


def test_repetition_penalty_near_zero_is_served_not_a_crash(engine, alone):
    """Dividing by 1e-300 overflows a logit to inf; softmax of it was NaN and the sampler raised."""
    params = SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=1, max_tokens=6, ignore_eos=True)
    out = run(engine, neighbours() + [("tiny-penalty", [3, 3, 4], params)])
    assert out["tiny-penalty"].error is None and len(out["tiny-penalty"].outputs[0].token_ids) == 6
    assert tokens(out) == {**alone, "tiny-penalty": out["tiny-penalty"].outputs[0].token_ids}
    assert_idle(engine)


def test_bans_known_to_leave_nothing_are_refused_before_running(engine):
    a = engine.tokenizer.encode("a", add_special_tokens=False)
    with pytest.raises(ValueError, match="^allowed_token_ids: .*bad_words"):
        engine.add_request("r", [3, 4], SamplingParams(allowed_token_ids=a, bad_words=["a"]))
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="^repetition_penalty: must be a finite number"):
            SamplingParams(repetition_penalty=value)
    assert_idle(engine)


def fail_forward_when(engine: LLMEngine, times: int | None = 1) -> list[int]:
    """Fault injection: the model's forward pass raises (as a kernel or a device would) for a
    batch holding MARKER, ``times`` times (None: always). Returns the list of failures so far."""
    original = engine.runner.model_forward
    failures: list[int] = []

    def forward(input_ids, *args, **kwargs):
        if (MARKER == input_ids).any() and (times is None or len(failures) < times):
            failures.append(int(input_ids.numel()))
            raise RuntimeError("injected kernel failure")
        return original(input_ids, *args, **kwargs)

    engine.runner.model_forward = forward
    return failures


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(qwen2_dir, cache_dir):
    engine = make_engine(qwen2_dir, cache_dir)
    poisoned = [MARKER] + list(range(100, 139))  # 40 tokens: two full KV blocks registered by its prefill
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = tokens(run(engine, neighbours() + [("poisoned", poisoned, params)]))
    engine.kv.reset_prefix_cache()
    for k, v in engine.runner.kv_caches:  # free blocks hold nothing of value: make that visible
        k.fill_(0.5)
        v.fill_(-0.5)

    failures = fail_forward_when(engine, times=1)
    out = run(engine, neighbours() + [("poisoned", poisoned, params)])
    assert len(failures) == 1 and engine.stats.failed_steps == 1
    failed = {rid for rid, o in out.items() if o.error is not None}
    assert "poisoned" in failed  # and whoever shared its step, with a 500 that says what happened
    for rid in failed:
        assert out[rid].error.status == 500 and "injected kernel failure" in out[rid].error.message
    assert all(tokens(out)[rid] == reference[rid] for rid in out if rid not in failed)
    assert_idle(engine)

    # the engine serves on, and the blocks the failed step never wrote are not served from the
    # prefix cache as if they held the poisoned prompt's KV
    again = run(engine, neighbours() + [("poisoned", poisoned, params)])
    assert tokens(again) == reference
    assert_idle(engine)


def test_an_engine_that_cannot_run_any_more_raises_engine_dead(qwen2_dir, cache_dir):
    engine = make_engine(qwen2_dir, cache_dir)

    def always_fails(*args, **kwargs):  # the probe's one-token forward fails too: the device is gone
        raise RuntimeError("device lost")

    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4))
    engine.runner.model_forward = always_fails
    engine.runner.decode_executor = None  # (the fused decode stack would serve the one-token probe)
    with pytest.raises(EngineDeadError, match="device lost"):
        engine.step()


def test_the_async_engine_fails_every_caller_and_reports_when_the_engine_dies(qwen2_dir, cache_dir):
    engine = make_engine(qwen2_dir, cache_dir)

    def gone(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.model_forward = gone
    engine.runner.decode_executor = None
    dead: list[BaseException] = []
    async_engine = AsyncEngine(engine, on_dead=dead.append)

    async def one(i: int) -> BaseException | None:
        try:
            async for _ in async_engine.generate(f"r{i}", [3, 4, 5 + i], SamplingParams(max_tokens=3)):
                pass
        except (EngineDeadError, RequestError) as exc:
            return exc
        return None

    async def main():
        return await asyncio.gather(*(one(i) for i in range(3)))

    errors = asyncio.run(main())
    async_engine.shutdown()
    assert all(isinstance(e, (EngineDeadError, RequestError)) for e in errors), errors
    assert len(dead) == 1 and isinstance(dead[0], EngineDeadError)
    assert isinstance(async_engine.error, EngineDeadError)


def test_llm_generate_raises_value_error_naming_the_field_and_keeps_serving(qwen2_dir, cache_dir):
    llm = LLM(model=str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir),
              num_gpu_blocks_override=128, max_model_len=512)
    bad = bans_that_empty_the_second_step(llm.llm_engine)
    good = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^allowed_token_ids, bad_words: .*\(prompt 1\)"):
        llm.generate([[5, 6, 7], [3, 4, 5]], [good, bad], use_tqdm=False)
    assert_idle(llm.llm_engine)
    out = llm.generate([[5, 6, 7]], good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
