"""The engine thread: adds between steps, cancellation aborts, idle coalescing window."""

from __future__ import annotations

import asyncio

from anna.core.sampling_params import SamplingParams
from anna.runtime.engine import LLMEngine
from anna.server.async_engine import AsyncEngine
from conftest import engine_settings
from helpers import record_batches


def test_idle_engine_coalesces_requests_that_arrive_together(qwen2_dir, cache_dir):
    engine = LLMEngine(engine_settings(qwen2_dir, cache_dir, skip_batch_wait_when_idle=False, batch_wait_ms=300),
                       show_progress=False)
    batches = record_batches(engine)
    async_engine = AsyncEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run(rid, prompt):
        last = None
        async for out in async_engine.generate(rid, prompt, params):
            last = out
        return last.outputs[0].token_ids

    async def main():
        return await asyncio.gather(run("a", list(range(3, 20))), run("b", list(range(30, 47))))

    try:
        outs = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert [len(o) for o in outs] == [3, 3]
    assert len(batches[0]) == 2  # both requests started in the same step


def test_cancelling_a_consumer_aborts_its_request(qwen2_dir, cache_dir):
    engine = LLMEngine(engine_settings(qwen2_dir, cache_dir), show_progress=False)
    async_engine = AsyncEngine(engine)

    async def main():
        seen = 0
        async for _ in async_engine.generate("x", list(range(3, 20)), SamplingParams(max_tokens=400,
                                                                                    ignore_eos=True)):
            seen += 1
            if seen == 3:
                break  # closes the generator: the request must be aborted
        for _ in range(200):  # bounded wait for the engine thread to apply the abort
            if engine.stats.aborted == 1 and not engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.01)
        return False

    try:
        assert asyncio.run(main())
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        async_engine.shutdown()
