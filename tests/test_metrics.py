"""Step classes and spike alerts, on synthetic step times."""

from __future__ import annotations

import logging

from anna.runtime.metrics import Histogram, StepStats
from anna.runtime.scheduler import StepClass


def test_spike_is_logged_only_above_three_times_the_rolling_mean(caplog):
    stats = StepStats()
    with caplog.at_level(logging.WARNING, logger="anna.runtime.metrics"):
        for _ in range(10):
            stats.record(StepClass.PURE_DECODE, 0.010)
        stats.record(StepClass.PURE_DECODE, 0.025)  # 2.5x: not a spike
        assert stats.spikes == 0
        stats.record(StepClass.PURE_DECODE, 0.050)
        assert stats.spikes == 1
        stats.record(StepClass.PREFILL_INSERT, 0.5)  # a new class has no history: never a spike
    assert stats.spikes == 1
    spikes = [r.message for r in caplog.records if "decode step spike" in r.message]
    assert len(spikes) == 1 and "50.0 ms" in spikes[0] and "class pure" in spikes[0]
    assert stats.summary().startswith("Decode step classes: pure=12 +prefill_insert=1 +budget_recompute=0")


def test_histogram_buckets_are_cumulative():
    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and abs(h.total - 3.65) < 1e-12


def test_warmup_table_derivation():
    from anna.runtime.warmup import warmup_table

    t = warmup_table(max_num_batched_tokens=2048, chunk_size=512, max_num_seqs=64, max_model_len=32768,
                     decode_steps=8)
    assert (t.prefill_lengths, t.batch_sizes, t.decode_steps) == ((13, 64, 256, 512, 2048), (1, 2, 4, 8), 8)
    t = warmup_table(max_num_batched_tokens=128, chunk_size=256, max_num_seqs=3, max_model_len=4096,
                     decode_steps=4, extra_prefill=100, extra_batch=3)
    assert (t.prefill_lengths, t.batch_sizes) == ((13, 64, 100, 128), (1, 2, 3))
    assert t.describe() == "Warmup shape table: prefill_lengths=[13, 64, 100, 128] batch_sizes=[1, 2, 3] decode_steps=4"


def test_warmup_runs_every_shape_and_leaves_no_trace(qwen2_dir, cache_dir, caplog):
    from anna.runtime.engine import LLMEngine
    from anna.runtime.warmup import run_warmup
    from conftest import engine_settings
    from helpers import record_batches

    engine = LLMEngine(engine_settings(qwen2_dir, cache_dir, max_num_batched_tokens=64, max_num_seqs=4,
                                       warmup_decode_steps=3), show_progress=False)
    seen = record_batches(engine)
    with caplog.at_level(logging.INFO, logger="anna.runtime.warmup"):
        table = run_warmup(engine)
    assert any("Warmup shape table: prefill_lengths=[13, 64]" in r.message for r in caplog.records)
    seen = [sorted(b) for b in seen]
    for n in table.prefill_lengths:
        assert [n] in seen
    for b in table.batch_sizes:
        assert [1] * b in seen  # a decode step at each batch size
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.prefix_cache_hits == 0 and engine.kv.prefix_cache_queries == 0
    assert not engine.kv.pool.cached  # warmup blocks are not kept as prefix cache
    assert engine.stats.generation_tokens == 0 and sum(engine.stats.steps.counts.values()) == 0


def test_profile_runtime_regions_and_identical_outputs(qwen2_dir, cache_dir):
    from anna.core.sampling_params import SamplingParams
    from anna.runtime.engine import LLMEngine
    from conftest import engine_settings
    from test_scheduler import drain

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # a 40-token prefill past the weight-streaming kernel's rows: the large-M path shows (the avx2
    # level's GEMM on the weights as stored; elsewhere the weights' row-major copies for torch's)
    gemv = dict(cpu_gemv_max_rows=16)
    plain = LLMEngine(engine_settings(qwen2_dir, cache_dir, **gemv), show_progress=False)
    profiled = LLMEngine(engine_settings(qwen2_dir, cache_dir, profile_runtime=True, **gemv), show_progress=False)
    for engine in (plain, profiled):
        engine.add_request("p", list(range(10, 50)), params)
    assert drain(profiled) == drain(plain)
    report = profiled.profiler.report()
    assert report["steps"] == 12
    names = set(report["regions"])
    assert {"rmsnorm", "rotary", "attention", "lm_head", "sampling", "cpu_launch_gap",
            "matmul:anna_gemv"} <= names
    kernels = profiled.runner.model.norm.ops.kernels
    if kernels is not None:
        assert report["regions"]["matmul:anna_panels" if kernels.level == "avx2" else "deinterleave"]["calls"] > 0
    assert 0 < sum(r["share_of_step"] for n, r in report["regions"].items() if n != "cpu_launch_gap") <= 1.0
    assert "Runtime profile over 12 steps" in profiled.profiler.table()
    assert plain.profiler is None
    # reset: what follows alone (a short prompt: no large-M matmul, and no gap before its first step)
    profiled.profiler.reset()
    profiled.add_request("q", list(range(10, 14)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    drain(profiled)
    report = profiled.profiler.report()
    assert report["steps"] == 5
    assert report["regions"]["cpu_launch_gap"]["calls"] == 4
    assert report["regions"]["sampling"]["calls"] == 5
    assert not {"matmul:anna_panels", "deinterleave"} & set(report["regions"])
