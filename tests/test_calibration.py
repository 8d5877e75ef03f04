"""Self-calibration of the CPU's routing thresholds (platforms/cpu/calibration.py): the choice is
a pure function of the measurements; the first start measures, stores and applies them as the
default layer (flags and ANNA_* values win); later starts read the store; a new host key measures
again; a calibration that cannot run leaves the built-in values; ``anna tune`` measures again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from anna.platforms.cpu.calibration import (ATTENTION_TOKENS, CHUNK_TOKENS, DOT_ROWS, GEMV_ROWS, PAIR_ROWS, calibrate, choose,
                                            first_crossing, first_lasting_win, smallest_good_chunk)
from conftest import engine_kernel_level, skip_without_cpu_kernels


@pytest.fixture
def store(tmp_path, cache_dir) -> Path:
    """A cache dir of the test's own (its calibration store) that shares the session's compiled kernels."""
    (cache_dir / "kernels").mkdir(exist_ok=True)
    (tmp_path / "kernels").symlink_to(cache_dir / "kernels", target_is_directory=True)
    return tmp_path


def _engine(model_dir: Path, cache_dir: Path, **kw):
    from anna import LLM

    kw.setdefault("calibrate", True)
    return LLM(str(model_dir), dtype="bfloat16", device="cpu", cache_dir=str(cache_dir), max_model_len=256,
               num_gpu_blocks_override=32, inference_warmup=False, **kw).llm_engine


def _stored(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "calibration").glob("*.json"))


def test_the_choice_is_a_pure_function_of_the_measurements():
    measurements = {
        # the kernel is no slower up to M = 16, slower from 32 on
        "cpu_gemv_max_rows": {"rows": [1, 8, 16, 32, 48], "kernel_s": [1, 2, 3.9, 5, 6], "other_s": [4, 4, 4, 4, 4]},
        # slower at the first M: never the packed kernel
        "int4_gemv_m_threshold": {"rows": [16, 32, 64], "kernel_s": [5, 1, 1], "other_s": [4, 4, 4]},
        # half precision no slower up to M = 2: fp32 from the next measured M on
        "cpu_upcast_min_rows": {"rows": [1, 2, 4, 8], "kernel_s": [1, 1, 3, 3], "other_s": [2, 2, 2, 2]},
        # per token: 15.6, 9.0, 7.8, 8.0 ms: 256 is the smallest within 20% of the best
        "long_prefill_token_threshold": {"tokens": [128, 256, 512, 1024], "seconds": [2.0, 2.3, 4.0, 8.2]},
        # bf16 dot products slower at M = 1 and 2, no slower from 4 on: on from M = 4
        "cpu_bf16_dot_min_rows": {"rows": [1, 2, 4, 8, 16], "kernel_s": [3, 3, 2, 1, 1], "other_s": [2, 2, 2, 2, 2]},
        # bf16 weights widened in registers no slower up to M = 32, slower from 64 on
        "cpu_bf16_pair_max_rows": {"rows": [4, 8, 16, 32, 64, 128], "kernel_s": [1, 1, 1, 2, 5, 5],
                                   "other_s": [2, 2, 2, 2, 4, 4]},
        # torch's SDPA ("other") slower than Anna's attention kernel up to 64 tokens, no slower from 256 on
        "cpu_sdpa_min_tokens": {"rows": [16, 64, 256, 1024], "kernel_s": [1, 2, 5, 9], "other_s": [2, 3, 4, 8]},
    }
    want = {"cpu_gemv_max_rows": 16, "int4_gemv_m_threshold": 0, "cpu_upcast_min_rows": 4,
            "long_prefill_token_threshold": 256, "cpu_bf16_dot_min_rows": 4, "cpu_bf16_pair_max_rows": 32,
            "cpu_sdpa_min_tokens": 256}
    assert choose(measurements) == want
    assert choose(json.loads(json.dumps(measurements))) == want  # as read back from the store
    assert choose({"cpu_gemv_max_rows": {"rows": [], "kernel_s": [], "other_s": []}}) == {}  # no data: built-in
    assert first_crossing([1, 2, 3], [1, 5, 1], [2, 2, 2]) == 1  # the first loss ends it, a later win does not count
    assert first_lasting_win([1, 2, 4], [1, 5, 1], [2, 2, 2]) == 4  # a win before a loss does not count
    assert first_lasting_win([1, 2, 4], [1, 1, 3], [2, 2, 2]) == 0  # slower at the largest M: never
    assert first_crossing([1, 2], [1, 1], [2, 2]) == 2  # never slower: the largest measured M
    assert choose({"cpu_upcast_min_rows": {"rows": [1, 2], "kernel_s": [1, 1], "other_s": [2, 2]}}) == \
        {"cpu_upcast_min_rows": 0}  # half never slower: never upcast
    assert smallest_good_chunk([128, 256], [1.0, 1.0]) == 256  # 128 costs twice as much per token
    sdpa = {"rows": [16, 64], "kernel_s": [1, 1], "other_s": [2, 2]}
    assert choose({"cpu_sdpa_min_tokens": sdpa}) == {"cpu_sdpa_min_tokens": 0}  # the kernel always faster: never
    sdpa = {"rows": [16, 64], "kernel_s": [2, 2], "other_s": [1, 1]}
    assert choose({"cpu_sdpa_min_tokens": sdpa}) == {"cpu_sdpa_min_tokens": 16}  # SDPA always faster


def test_a_long_first_call_is_its_own_sample(monkeypatch):
    """A shape's first call is timed again only when it was short: the code generation and
    first-touch pages it pays for are milliseconds, and a long call timed twice spent a slow host's
    budget on the second call (the largest M of the int4 bound filled most of its first round)."""
    from anna.platforms.cpu import calibration
    from anna.platforms.cpu.calibration import WARM_UP_MAX_S, Timer

    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    timer = Timer(budget_s=100.0)

    def call_taking(*durations: float):
        calls = iter(durations)

        def fn() -> None:
            clock[0] += next(calls)
        return fn

    long, short = WARM_UP_MAX_S * 1.5, WARM_UP_MAX_S / 2
    assert timer.seconds(call_taking(long), warm_up=True) == pytest.approx(long)  # one call, a sample
    assert timer.seconds(call_taking(short, 0.001), warm_up=True) == pytest.approx(0.001)  # warmed, then timed
    assert timer.seconds(call_taking(short), warm_up=False) == pytest.approx(short)
    clock[0] = 101.0
    with pytest.raises(calibration.OutOfTime):
        timer.seconds(call_taking(short), warm_up=False)


def test_the_lm_head_is_timed_only_at_the_rows_a_step_samples():
    """A step's lm_head multiplies the sampled positions only (at most max_num_seqs): at larger M
    (prefill chunks) a pass of the model does not include it."""
    from anna.platforms.cpu.calibration import LayerGroup, Timer, _model_seconds

    seen: list[tuple[str, int]] = []

    class Layer(torch.nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name, self.in_features = name, 8

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((self.name, x.shape[0]))
            return x

    groups = [LayerGroup((Layer("body"),), False), LayerGroup((Layer("lm_head"),), True)]
    for rows in (64, 65):
        _model_seconds(Timer(10.0, sampled_rows=64), groups, rows, warm_up=False)
    assert seen == [("body", 64), ("lm_head", 64), ("body", 65)]


def test_a_pass_streams_enough_layers_from_memory_and_scales_to_all():
    """A decode step reads each layer's weights from memory; one layer timed again and again sits
    in the cache instead (there, bf16 dot products won at M = 1 on a Zen 4 where decode ran ~20%
    slower on them). Up to STREAMED_MAX_ROWS rows, a group is timed over its first layers up to
    STREAMED_BYTES of weights, in model order, and scaled to its count (a group smaller than that
    is timed whole); above, where compute decides, over its first layer."""
    from anna.platforms.cpu.calibration import STREAMED_BYTES, STREAMED_MAX_ROWS, LayerGroup, Timer, _model_seconds

    seen: list[int] = []

    class Layer(torch.nn.Module):
        def __init__(self, index: int, nbytes: int) -> None:
            super().__init__()
            self.index, self.in_features = index, 8
            self.register_buffer("weight", torch.empty(nbytes, dtype=torch.uint8), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self.index)
            return x

    quarter = STREAMED_BYTES // 4
    big = LayerGroup(tuple(Layer(i, quarter) for i in range(24)), False)
    assert big.count == 24 and [layer.index for layer in big.streamed()] == [0, 1, 2, 3]
    small = LayerGroup(tuple(Layer(100 + i, 1024) for i in range(3)), False)
    assert small.streamed() == small.layers

    class FixedTimer(Timer):  # every timed call "takes" one second
        def seconds(self, fn, warm_up):
            fn()
            return 1.0

    assert _model_seconds(FixedTimer(10.0), [big, small], STREAMED_MAX_ROWS, warm_up=False) == 24 / 4 + 3 / 3
    assert seen == [0, 1, 2, 3, 100, 101, 102]
    seen.clear()
    assert _model_seconds(FixedTimer(10.0), [big, small], STREAMED_MAX_ROWS + 1, warm_up=False) == 24 + 3
    assert seen == [0, 100]


def test_the_first_start_measures_stores_and_applies(qwen2_dir, store):
    skip_without_cpu_kernels()  # (these settings are Anna's kernels' bounds)
    engine = _engine(qwen2_dir, store)
    [path] = _stored(store)
    stored = json.loads(path.read_text())
    values = stored["values"]
    # a bf16 model on Anna's kernels; the bf16 dot products where the level in use has them (the
    # CPU's, or a lower one that ANNA_CPU_ISA forces) ...
    routing = engine.runner.model.norm.ops.routing
    dot = {"cpu_bf16_dot_min_rows"} if routing.bf16_matmul else set()
    # ... or, on the avx2 level's kernels, the bound of bf16 weights widened in registers
    pairs = {"cpu_bf16_pair_max_rows"} if engine.runner.model.norm.ops.kernels.widens_bf16_pairs else set()
    assert set(values) == {"cpu_gemv_max_rows", "cpu_sdpa_min_tokens", "long_prefill_token_threshold"} | dot | pairs
    assert choose(stored["measurements"]) == values  # deterministic given what it measured
    gemv = stored["measurements"]["cpu_gemv_max_rows"]
    assert gemv["rows"] == list(GEMV_ROWS[:len(gemv["rows"])]) and len(gemv["rows"]) >= 2
    assert all(t > 0 for t in gemv["kernel_s"] + gemv["other_s"])
    assert stored["measurements"]["long_prefill_token_threshold"]["tokens"] == list(CHUNK_TOKENS)
    assert stored["host"]["threads"] == torch.get_num_threads() and stored["host"]["torch"] == torch.__version__
    for name, value in values.items():
        assert getattr(engine.settings, name) == value and engine.settings.sources[name] == "calibrated"
    assert engine.runner.model.norm.ops.routing.gemv_max_rows == values["cpu_gemv_max_rows"]
    if dot:
        assert stored["measurements"]["cpu_bf16_dot_min_rows"]["rows"] == list(DOT_ROWS)
        assert routing.bf16_dot_rows == values["cpu_bf16_dot_min_rows"]
    if pairs:
        measured = stored["measurements"]["cpu_bf16_pair_max_rows"]["rows"]
        assert len(measured) >= 2 and measured == list(PAIR_ROWS[:len(measured)])
        assert routing.bf16_pair_max_rows == values["cpu_bf16_pair_max_rows"]
    attention = stored["measurements"]["cpu_sdpa_min_tokens"]  # every length, both paths
    assert attention["rows"] == list(ATTENTION_TOKENS) and all(t > 0 for t in attention["kernel_s"] + attention["other_s"])
    assert routing.sdpa_min_tokens == values["cpu_sdpa_min_tokens"]
    assert engine.scheduler.config.long_prefill_token_threshold == values["long_prefill_token_threshold"]
    assert "calibrated" in engine.settings.table()


def test_a_stored_calibration_is_read_not_measured_and_a_new_key_measures_again(qwen2_dir, store, monkeypatch):
    _engine(qwen2_dir, store)
    [path] = _stored(store)
    stored = json.loads(path.read_text())
    stored["values"] = {"cpu_gemv_max_rows": 37, "long_prefill_token_threshold": 384}  # no measurement gives these
    path.write_text(json.dumps(stored))
    engine = _engine(qwen2_dir, store)
    assert engine.runner.model.norm.ops.routing.gemv_max_rows == 37
    assert engine.scheduler.config.long_prefill_token_threshold == 384
    assert json.loads(path.read_text()) == stored  # not measured again, so not rewritten

    import anna
    monkeypatch.setattr(anna, "__version__", anna.__version__ + ".post1")  # another Anna: another key
    engine = _engine(qwen2_dir, store)
    assert len(_stored(store)) == 2
    assert engine.runner.model.norm.ops.routing.gemv_max_rows != 37
    monkeypatch.undo()
    torch.set_num_threads(1)  # another thread count: another key
    try:
        _engine(qwen2_dir, store)
    finally:
        torch.set_num_threads(2)
    assert len(_stored(store)) == 3
    assert json.loads(path.read_text()) == stored  # the first host's entry is left as it was


def test_flags_env_and_the_interactive_profile_win_over_calibrated_values(qwen2_dir, store, monkeypatch):
    skip_without_cpu_kernels()  # (these settings are Anna's kernels' bounds)
    monkeypatch.setenv("ANNA_LONG_PREFILL_TOKEN_THRESHOLD", "300")
    engine = _engine(qwen2_dir, store, cpu_gemv_max_rows=64)
    assert engine.runner.model.norm.ops.routing.gemv_max_rows == 64
    assert engine.settings.sources["cpu_gemv_max_rows"] != "calibrated"
    assert engine.settings.long_prefill_token_threshold == 300 and engine.settings.sources[
        "long_prefill_token_threshold"] == "env"
    monkeypatch.delenv("ANNA_LONG_PREFILL_TOKEN_THRESHOLD")
    engine = _engine(qwen2_dir, store, scheduler_profile="interactive")  # its chunk is chosen for latency
    assert engine.settings.long_prefill_token_threshold == 256 and engine.settings.sources[
        "long_prefill_token_threshold"] == "profile"
    assert engine.settings.sources["cpu_gemv_max_rows"] == "calibrated"


def test_no_calibrate_keeps_the_built_in_values(qwen2_dir, store):
    engine = _engine(qwen2_dir, store, calibrate=False)
    assert not (store / "calibration").exists()
    assert engine.settings.sources["cpu_gemv_max_rows"] == "default"
    assert engine.runner.model.norm.ops.routing.gemv_max_rows == 128


def test_a_calibration_that_cannot_run_leaves_the_built_in_values(qwen2_dir, store, caplog):
    skip_without_cpu_kernels()  # (these settings are Anna's kernels' bounds)
    engine = _engine(qwen2_dir, store, calibrate=False)
    model, ops, isa = engine.runner.model, engine.runner.model.norm.ops, engine_kernel_level()
    nothing = calibrate(model, ops, isa, cache_dir=str(store), max_chunk=2048, max_rows=64, budget_s=0.0)
    assert nothing is not None and nothing.values == {}  # no time to measure: no value replaces a built-in

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel here")

    assert calibrate(model, ops, isa, cache_dir=str(store), max_chunk=2048, max_rows=64, refresh=True,
                     measure_fn=broken) is None
    assert "Calibration failed (RuntimeError: no such kernel here)" in caplog.text
    assert ops.routing.gemv_max_rows == 128  # (measuring restores the routing it changes)

    # a corrupt store is measured again and rewritten; a store that cannot be written still calibrates
    [path] = _stored(store)
    path.write_text("{not json")
    _engine(qwen2_dir, store)
    assert "cpu_gemv_max_rows" in json.loads(path.read_text())["values"]
    for stale in _stored(store):
        stale.unlink()
    (store / "calibration").rmdir()
    (store / "calibration").write_text("")  # a file where the store's folder would be
    engine = _engine(qwen2_dir, store)
    assert engine.settings.sources["cpu_gemv_max_rows"] == "calibrated"
    assert "Calibration not stored" in caplog.text


def test_every_setting_is_measured_once_before_any_is_measured_again(qwen2_dir, store, monkeypatch):
    """The later rounds run breadth-first: a budget that covers the first rounds and no more leaves
    every setting that applies with every point of its first round (depth-first, the first setting's
    extra rounds took the budget and the chunk size was never measured on a Zen 1); with room for
    more, every point keeps its best time."""
    from anna.platforms.cpu import calibration
    from anna.platforms.cpu.calibration import OutOfTime, Timer, measure

    class CallBudget(Timer):  # the budget counts timed calls; each call "takes" ``take`` seconds
        def __init__(self, calls: int, take=lambda: 1.0) -> None:
            super().__init__(budget_s=0.0)
            self.calls, self.left, self.take = 0, calls, take

        def seconds(self, fn, warm_up):
            if self.left == 0:
                raise OutOfTime
            self.left -= 1
            self.calls += 1
            return self.take()

    engine = _engine(qwen2_dir, store, calibrate=False)
    model, ops = engine.runner.model, engine.runner.model.norm.ops
    monkeypatch.setattr(calibration, "ROUNDS", 1)
    first = CallBudget(10 ** 6)
    full = measure(model, ops, max_chunk=2048, timer=first)
    assert "long_prefill_token_threshold" in full and len(full) >= 2
    monkeypatch.setattr(calibration, "ROUNDS", 3)
    assert measure(model, ops, max_chunk=2048, timer=CallBudget(first.calls)) == full
    assert ops.routing.gemv_max_rows == 128  # (measuring restores the routing it changes)

    # room for every round: each point keeps the least of its three times (round r's calls take 1/r s)
    budget = CallBudget(10 ** 6, take=lambda: 1.0 / (1 + (budget.calls - 1) // first.calls))
    best = measure(model, ops, max_chunk=2048, timer=budget)
    assert budget.calls == 3 * first.calls
    assert {name: m["rows" if "rows" in m else "tokens"] for name, m in best.items()} == \
        {name: m["rows" if "rows" in m else "tokens"] for name, m in full.items()}
    for name, m in best.items():  # (a pass's seconds scale each timed call to its group's layers)
        for series in {"kernel_s", "other_s", "seconds"} & set(m):
            assert m[series] == pytest.approx([t / 3 for t in full[name][series]]), (name, series)


def test_anna_tune_measures_again_and_stores(qwen2_dir, store, capsys):
    skip_without_cpu_kernels()  # (these settings are Anna's kernels' bounds)
    from anna.cli.main import main

    args = ["tune", str(qwen2_dir), "--dtype", "bfloat16", "--cache-dir", str(store), "--quiet",
            "--max-model-len", "256", "--num-gpu-blocks-override", "32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    [path] = _stored(store)
    values = json.loads(path.read_text())["values"]
    assert f"cpu_gemv_max_rows = {values['cpu_gemv_max_rows']}" in out
    assert f"cpu_gemv_max_rows = {values['cpu_gemv_max_rows']} (calibrated)" in out
    stored = json.loads(path.read_text())
    stored["values"]["cpu_gemv_max_rows"] = 37
    path.write_text(json.dumps(stored))
    assert main(args + ["--no-calibrate"]) == 0  # tune measures whatever the start-up setting says
    assert json.loads(path.read_text())["values"]["cpu_gemv_max_rows"] != 37


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_quantized_model_calibrates_the_packed_kernels_bound(qwen2_dir, store, quantization):
    """Each kind's packed kernel has its own bound, measured on its own layers; the other kind's
    is not measured (nothing of the model would run it), nor cpu_gemv_max_rows for an int8 model
    whose every linear layer is int8."""
    skip_without_cpu_kernels()  # (these settings are Anna's kernels' bounds)
    engine = _engine(qwen2_dir, store, quantization=quantization, disable_int4_cache=True)
    [path] = _stored(store)
    stored = json.loads(path.read_text())
    name, other = f"{quantization}_gemv_m_threshold", "int8_gemv_m_threshold" if quantization == "int4" \
        else "int4_gemv_m_threshold"
    assert name in stored["measurements"] and other not in stored["measurements"]
    assert getattr(engine.runner.model.norm.ops.routing, name) == stored["values"][name]
    assert engine.settings.sources[name] == "calibrated"
    if quantization == "int8":
        assert "cpu_gemv_max_rows" not in stored["measurements"]
