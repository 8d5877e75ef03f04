"""Self-calibration of the CPU's routing thresholds and prefill chunk size on this host, for this
model's shapes.

The built-in thresholds (which kernel serves a matmul of M rows, how many prompt tokens one
step prefills beside decodes) were measured on one machine; the same 2-core machine class comes
as AVX2-only, AVX-512 and AMX CPUs, where the crossovers differ several-fold. So the first start
on a new host times the model's own layers through the model's own ops (a few seconds, bounded
by BUDGET_S, before serving: never on the request path) and keeps the result in
``{cache_dir}/calibration/<key>.json``. The key covers the CPU model, its core count and
instruction sets, the thread count, torch's and Anna's versions, the build of Anna's kernels,
and the model's dtype, format and linear shapes; anything else that changed selects another file. The values are the default
layer: a flag or ANNA_* value still wins (the settings table says ``calibrated`` where one was
used), ``anna tune MODEL`` measures again, ``--no-calibrate`` keeps the built-in values.

What is measured, each as the whole model's matmul time at a few M: each distinct layer shape
timed once and scaled to the layers that have it. Up to STREAMED_MAX_ROWS rows of x, where
reading the weights is most of a matmul's time, it is timed over enough of the model's layers of
that shape (STREAMED_BYTES of weights) that they come from memory, as in a decode step; one layer
timed again and again sits in the last-level cache, where compute decides (on a Zen 4, bf16 dot
products then won at M = 1, and batch-1 decode, which streams the weights, ran ~25% slower on
them). Above it, one layer of each shape is timed.
- ``cpu_bf16_dot_min_rows`` (a bf16 model on Anna's kernels, where the CPU has AVX512-BF16): the
  weight-streaming kernel on bf16 dot products against the same kernel in fp32, at every M of
  DOT_ROWS; measured first, so that the bound below is measured on the kernel that will run;
- ``cpu_gemv_max_rows`` (Anna's kernels, dense layers): the weight-streaming kernel
  against the path above it, the large-M GEMM (Anna's AMX tiles or register-blocked GEMM where the
  kernel level has one for the weights, else torch's bf16 or fp32 GEMM: the start-up log names it);
- ``cpu_bf16_pair_max_rows`` (a bf16 model on Anna's AVX2 kernels): the weight-streaming kernel
  widening bf16 weights in registers against the same kernel converting each block once, at the
  Ms of PAIR_ROWS, on the layers (not the lm_head). Measured after the bound above, which moves
  prefill far more;
- ``int4_gemv_m_threshold`` (int4 with int4_matmul auto) and ``int8_gemv_m_threshold`` (int8):
  the packed kernel against the dequantized GEMM, at the Ms of PACKED_ROWS;
- ``cpu_upcast_min_rows`` (torch's ops on half weights without hardware bf16): torch's half
  matmul against the fp32 one on the converted weight;
- ``cpu_sdpa_min_tokens`` (a model with attention layers, on Anna's kernels): one layer's prompt
  attention over ATTENTION_TOKENS tokens (no larger than the chunk), Anna's kernel against torch's
  SDPA in the model's attention dtype; SDPA from the smallest length on which it is no slower at
  every longer one (on an AMX CPU oneDNN's bf16 tiles run it several times the kernel; on a Zen 4
  the kernel ran twice SDPA);
- ``long_prefill_token_threshold`` (the throughput profile's chunk size): the smallest chunk
  whose matmul time per token is within 20% of the best chunk's (CHUNK_TOLERANCE).
Each setting's first round (every M once, in the order above; a setting uses the first-round
choices of those before it) runs before any setting is timed again, and the later rounds go
breadth-first, so that a slow host's budget runs out on extra samples, not on a setting left at its
built-in value (on a Zen 1, three rounds of ``cpu_gemv_max_rows`` alone took the whole budget).
``choose`` turns measurements into values and is a pure function of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import anna
from anna.model.cache_spec import AttentionSpec
from anna.model.linear import Linear, QuantLinear
from anna.platforms.cpu.isa import LEVEL_FLAGS, CpuIsa

log = logging.getLogger(__name__)

FORMAT_VERSION = 4  # 2: layers timed streamed from memory (STREAMED_BYTES); 3: prompt attention; 4: int8's own bound
WARM_UP_MAX_S = 0.2  # a first call this long is its own sample (Timer.seconds)
BUDGET_S = 15.0  # the most one calibration measures; what is left unmeasured keeps its built-in value
STREAMED_BYTES = 64 << 20  # weights per timed pass: twice a 32 MB last-level cache
STREAMED_MAX_ROWS = 16
GEMV_ROWS = (1, 8, 16, 32, 48, 64, 96, 128, 192, 256)
DOT_ROWS = (1, 2, 4, 8, 16)
PAIR_ROWS = (4, 8, 16, 32, 64, 128)
PACKED_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)  # int4 and int8
UPCAST_ROWS = (1, 2, 4, 8, 16, 32, 64)
CHUNK_TOKENS = (128, 256, 512, 1024, 2048)
ATTENTION_TOKENS = (16, 64, 256, 1024, 2048)
CHUNK_TOLERANCE = 1.20  # the chunk is also the longest stall of the decodes beside it: the smallest within 20%


class OutOfTime(Exception):
    """The calibration's time budget ran out."""


@dataclass(frozen=True)
class LayerGroup:
    """The model's linear layers of one shape and format."""

    layers: tuple[Any, ...]
    lm_head: bool

    @property
    def layer(self) -> Any:
        return self.layers[0]

    @property
    def count(self) -> int:
        return len(self.layers)

    def streamed(self) -> tuple[Any, ...]:
        """The first of its layers whose weights add up to STREAMED_BYTES (all, if they are fewer)."""
        total = 0
        for i, layer in enumerate(self.layers):
            total += sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
            if total >= STREAMED_BYTES:
                return self.layers[:i + 1]
        return self.layers


@dataclass(frozen=True)
class Calibration:
    """What one calibration measured (seconds per whole-model pass at each M) and what follows."""

    key: str
    host: dict[str, Any]
    measurements: dict[str, dict[str, list]]
    values: dict[str, int]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"format": FORMAT_VERSION}


def layer_groups(model: torch.nn.Module) -> list[LayerGroup]:
    """The model's linear layers, grouped by (format, shape, bias, lm_head), in model order."""
    groups: dict[tuple, list] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (Linear, QuantLinear)):
            continue
        lm_head = name.split(".")[-1] == "lm_head"
        key = (_format(module), module.out_features, module.in_features, module.bias is not None, lm_head)
        groups.setdefault(key, []).append(module)
    return [LayerGroup(tuple(layers), key[-1]) for key, layers in groups.items()]


def host_identity(isa: CpuIsa) -> dict[str, Any]:
    return {"cpu": isa.model_name, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "isa": isa.level, "flags": sorted(isa.flags & _ISA_FLAGS), "torch": torch.__version__,
            "anna": anna.__version__}


_ISA_FLAGS = frozenset(flag for flags in LEVEL_FLAGS.values() for flag in flags)  # the flags the levels read


def calibration_key(host: dict[str, Any], model_ident: dict[str, Any]) -> str:
    ident = {"format": FORMAT_VERSION, "host": host, "model": model_ident}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def model_identity(groups: list[LayerGroup], ops: Any, max_chunk: int, max_rows: int) -> dict[str, Any]:
    shapes = sorted([_format(g.layer), g.layer.out_features, g.layer.in_features, g.count, g.lm_head] for g in groups)
    return {"shapes": shapes, "kernels": ops.kernels.build_id if ops.kernels is not None else None,
            "bf16_matmul": ops.routing.bf16_matmul,
            "int4_matmul": ops.routing.int4_matmul, "max_chunk": max_chunk, "max_rows": max_rows}


def _format(layer: Any) -> str:
    return f"q{layer.kind}g{layer.group}" if isinstance(layer, QuantLinear) else str(layer.weight.dtype)


# ---- the choice: a pure function of the measurements ----

def first_crossing(rows: list[int], kernel_s: list[float], other_s: list[float]) -> int:
    """The largest M of ``rows`` (ascending) up to which the kernel is no slower than the other
    path at every measured M; 0 when it is slower at the first."""
    best = 0
    for m, kernel, other in zip(rows, kernel_s, other_s):
        if kernel > other:
            break
        best = m
    return best


def first_lasting_win(rows: list[int], kernel_s: list[float], other_s: list[float]) -> int:
    """The smallest M of ``rows`` (ascending) from which the kernel is no slower than the other
    path at every measured M; 0 when it is slower at the last."""
    best = 0
    for m, kernel, other in reversed(list(zip(rows, kernel_s, other_s))):
        if kernel > other:
            break
        best = m
    return best


def smallest_good_chunk(tokens: list[int], seconds: list[float], tolerance: float = CHUNK_TOLERANCE) -> int:
    """The smallest chunk whose time per token is within ``tolerance`` of the best measured one's."""
    per_token = [s / n for n, s in zip(tokens, seconds)]
    best = min(per_token)
    return next(n for n, cost in zip(tokens, per_token) if cost <= tolerance * best)


def choose(measurements: dict[str, dict[str, list]]) -> dict[str, int]:
    """Setting name -> calibrated value, for each measurement that has data."""
    values: dict[str, int] = {}
    m = measurements.get("cpu_bf16_dot_min_rows")
    if m and m["rows"]:
        values["cpu_bf16_dot_min_rows"] = first_lasting_win(m["rows"], m["kernel_s"], m["other_s"])
    for name in ("cpu_bf16_pair_max_rows", "cpu_gemv_max_rows", "int4_gemv_m_threshold", "int8_gemv_m_threshold",
                 "cpu_upcast_min_rows"):
        m = measurements.get(name)
        if m and m["rows"]:
            crossing = first_crossing(m["rows"], m["kernel_s"], m["other_s"])
            if name == "cpu_upcast_min_rows":  # "kernel" = the half matmul: fp32 from the next M on
                later = [r for r in m["rows"] if r > crossing]
                crossing = later[0] if later else 0
            values[name] = crossing
    m = measurements.get("cpu_sdpa_min_tokens")
    if m and m["rows"]:  # ("kernel": Anna's attention kernel, "other": torch's SDPA)
        values["cpu_sdpa_min_tokens"] = first_lasting_win(m["rows"], m["other_s"], m["kernel_s"])
    m = measurements.get("long_prefill_token_threshold")
    if m and m["tokens"]:
        values["long_prefill_token_threshold"] = smallest_good_chunk(m["tokens"], m["seconds"])
    return values


# ---- measuring ----

class Timer:
    """Times calls against one deadline; ``sampled_rows``: the most positions one step samples
    (max_num_seqs), the largest M the lm_head sees."""

    def __init__(self, budget_s: float, sampled_rows: int = 1 << 30) -> None:
        self.deadline = time.perf_counter() + budget_s
        self.sampled_rows = sampled_rows

    def seconds(self, fn: Callable[[], Any], warm_up: bool) -> float:
        """One call's seconds; with ``warm_up``, a shape's first: it is timed again unless it took
        WARM_UP_MAX_S or more (the first call pays for oneDNN's code generation and first-touch
        pages, milliseconds that matter to a short call only, and the later rounds keep the best)."""
        if time.perf_counter() > self.deadline:
            raise OutOfTime
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        if not warm_up or first >= WARM_UP_MAX_S:
            return first
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


ROUNDS = 3  # every M is timed once per round and keeps its best: rounds spread its samples over time,
# so that this VM's slow spells (seconds long) do not land on one M only


@dataclass
class Series:
    """One setting's measurement: the points its first round timed (``out[point]``, with a list of
    seconds per name in ``names``) and how to time a point again, in the same routing."""

    out: dict[str, list]
    point: str
    names: tuple[str, ...]
    again: Callable[[int], list[float]]


def _later_rounds(series: list[Series]) -> None:
    """Rounds 2..ROUNDS, breadth-first: each round times every setting's points once more and each
    point keeps its best. The budget that runs out cuts a round short, keeping what it finished, but
    never leaves a setting unmeasured behind another's extra rounds (on a Zen 1, the three rounds
    of cpu_gemv_max_rows alone took the whole budget)."""
    for _ in range(ROUNDS - 1):
        for s in series:
            for i, x in enumerate(s.out[s.point]):
                try:
                    times = s.again(x)
                except OutOfTime:
                    return
                for name, t in zip(s.names, times):
                    s.out[name][i] = min(s.out[name][i], t)


@contextmanager
def _routing(ops: Any, **changes: Any) -> Iterator[None]:
    saved = ops.routing
    ops.routing = dataclasses.replace(saved, **changes)
    try:
        yield
    finally:
        ops.routing = saved


def _model_seconds(timer: Timer, groups: list[LayerGroup], rows: int, warm_up: bool) -> float:
    """Seconds of one pass of these layers (each group's layers timed once, its streamed ones up
    to STREAMED_MAX_ROWS rows, else its first, scaled to its count). The lm_head multiplies only
    the positions a step samples, at most ``timer.sampled_rows``: beyond that M it is not part of
    a pass."""
    total = 0.0
    for g in groups:
        if g.lm_head and rows > timer.sampled_rows:
            continue
        layers = g.streamed() if rows <= STREAMED_MAX_ROWS else g.layers[:1]
        x = torch.randn(rows, g.layer.in_features)
        total += g.count / len(layers) * timer.seconds(lambda: [layer(x) for layer in layers], warm_up)
    return total


def _crossover(timer: Timer, ops: Any, groups: list[LayerGroup], rows: tuple[int, ...],
               kernel: Callable[[int], dict[str, Any]], other: dict[str, Any],
               losses_to_stop: int = 2) -> Series:
    """Both paths at each M, the first round; it stops once the kernel has lost at
    ``losses_to_stop`` Ms in a row (0: every M is measured)."""
    def at(m: int, warm_up: bool = False) -> list[float]:
        with _routing(ops, **kernel(m)):
            k = _model_seconds(timer, groups, m, warm_up)
        with _routing(ops, **other):
            return [k, _model_seconds(timer, groups, m, warm_up)]

    return _paired_first_round(rows, at, losses_to_stop)


def _paired_first_round(points: Iterable[int], at: Callable[..., list[float]], losses_to_stop: int = 0) -> Series:
    """The first round of a kernel-against-other measurement: ``at(point, warm_up=True)`` gives
    [kernel, other] seconds at each point, until the budget runs out or the kernel has lost at
    ``losses_to_stop`` points in a row (0: every point is measured)."""
    out: dict[str, list] = {"rows": [], "kernel_s": [], "other_s": []}
    losses = 0
    for point in points:
        try:
            kernel, other = at(point, warm_up=True)
        except OutOfTime:
            break
        out["rows"].append(point)
        out["kernel_s"].append(kernel)
        out["other_s"].append(other)
        losses = losses + 1 if kernel > other else 0
        if losses_to_stop and losses == losses_to_stop:
            break
    return Series(out, "rows", ("kernel_s", "other_s"), at)


def attention_shape(model: torch.nn.Module) -> tuple[int, int, int, int, torch.dtype] | None:
    """(query heads, KV heads, head dim, layers, activation dtype) of the model's paged attention
    layers, or None when it has none."""
    specs = [spec for spec in model.cache_specs(model.activation_dtype) if isinstance(spec, AttentionSpec)]
    if not specs:
        return None
    return (model.config.num_attention_heads, specs[0].num_kv_heads, specs[0].head_dim, len(specs),
            model.activation_dtype)


def _attention(timer: Timer, ops: Any, shape: tuple[int, int, int, int, torch.dtype], max_tokens: int) -> Series:
    """One layer's prompt attention over each of ATTENTION_TOKENS up to ``max_tokens`` (scaled to
    the model's attention layers), on Anna's kernel and on torch's SDPA: every length is measured."""
    heads, kv_heads, dim, layers, dtype = shape

    def at(n: int, warm_up: bool = False) -> list[float]:
        q, k, v = (torch.randn(n, h, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads))
        times = []
        for sdpa in (0, 1):
            with _routing(ops, sdpa_min_tokens=sdpa):
                times.append(layers * timer.seconds(lambda: ops.causal_attention(q, k, v, dim ** -0.5), warm_up))
        return times

    return _paired_first_round((t for t in ATTENTION_TOKENS if t <= max_tokens), at)


def _chunks(timer: Timer, ops: Any, body: list[LayerGroup], max_chunk: int, routing: dict[str, Any]) -> Series:
    """The body's matmul time at each chunk of CHUNK_TOKENS up to ``max_chunk``, in ``routing``."""
    def at(n: int, warm_up: bool = False) -> list[float]:
        with _routing(ops, **routing):
            return [_model_seconds(timer, body, n, warm_up)]

    out: dict[str, list] = {"tokens": [], "seconds": []}
    for n in (c for c in CHUNK_TOKENS if c <= max_chunk):
        try:
            [seconds] = at(n, warm_up=True)
        except OutOfTime:
            break
        out["tokens"].append(n)
        out["seconds"].append(seconds)
    return Series(out, "tokens", ("seconds",), at)


def measure(model: torch.nn.Module, ops: Any, max_chunk: int, budget_s: float = BUDGET_S,
            max_rows: int = 1 << 30, timer: Timer | None = None) -> dict[str, dict[str, list]]:
    """Measurements for each setting that applies to this model and ops (``max_rows``: the most
    positions a step samples, max_num_seqs; ``timer``, where given, brings its own deadline and
    sampled rows instead of ``budget_s`` and ``max_rows``). Every setting's first round runs before
    any setting's second (_later_rounds); a setting measured after another uses that one's
    first-round choice."""
    timer = timer or Timer(budget_s, max_rows)
    groups = layer_groups(model)
    dense = [g for g in groups if not isinstance(g.layer, QuantLinear)]
    int8 = [g for g in groups if isinstance(g.layer, QuantLinear) and g.layer.kind == 0]
    int4 = [g for g in groups if isinstance(g.layer, QuantLinear) and g.layer.kind == 1]
    half = [g for g in groups if not isinstance(g.layer, QuantLinear) and g.layer.weight.element_size() == 2]
    bf16 = [g for g in dense if g.layer.weight.dtype == torch.bfloat16]
    series: dict[str, Series] = {}

    def chosen() -> dict[str, int]:
        return choose({name: s.out for name, s in series.items()})

    with torch.inference_mode():
        if ops.kernels is not None and bf16 and ops.routing.bf16_matmul:
            kernel_serves = {"gemv_max_rows": max(DOT_ROWS)}  # the weight-streaming kernel, with and without
            series["cpu_bf16_dot_min_rows"] = _crossover(timer, ops, bf16, DOT_ROWS,
                                                         lambda m: kernel_serves | {"bf16_dot_rows": 1},
                                                         kernel_serves | {"bf16_dot_rows": 0}, losses_to_stop=0)
        if ops.kernels is not None and dense:
            dot = {"bf16_dot_rows": chosen().get("cpu_bf16_dot_min_rows", ops.routing.bf16_dot_rows)}
            series["cpu_gemv_max_rows"] = _crossover(timer, ops, dense, GEMV_ROWS,
                                                     lambda m: dot | {"gemv_max_rows": m}, dot | {"gemv_max_rows": 0})
        # (the layers' shapes only: the crossover is the kernel's, and a tied lm_head at 128 rows
        # would cost more of the budget than all of them)
        bf16_body = [g for g in bf16 if not g.lm_head]
        if ops.kernels is not None and bf16_body and ops.kernels.widens_bf16_pairs:
            kernel_serves = {"gemv_max_rows": max(PAIR_ROWS)}  # the weight-streaming kernel, either way
            series["cpu_bf16_pair_max_rows"] = _crossover(timer, ops, bf16_body, PAIR_ROWS,
                                                          lambda m: kernel_serves | {"bf16_pair_max_rows": m},
                                                          kernel_serves | {"bf16_pair_max_rows": 0})
        if ops.kernels is not None and int4 and ops.routing.int4_matmul == "auto":
            series["int4_gemv_m_threshold"] = _crossover(timer, ops, int4, PACKED_ROWS,
                                                         lambda m: {"int4_gemv_m_threshold": m},
                                                         {"int4_gemv_m_threshold": 0})
        if ops.kernels is not None and int8:
            series["int8_gemv_m_threshold"] = _crossover(timer, ops, int8, PACKED_ROWS,
                                                         lambda m: {"int8_gemv_m_threshold": m},
                                                         {"int8_gemv_m_threshold": 0})
        if ops.kernels is None and half and not ops.routing.bf16_matmul:
            series["cpu_upcast_min_rows"] = _crossover(timer, ops, half, UPCAST_ROWS,
                                                       lambda m: {"upcast_min_rows": 0}, {"upcast_min_rows": 1})
        shape = attention_shape(model)
        if ops.kernels is not None and shape is not None and shape[2] % 8 == 0:
            series["cpu_sdpa_min_tokens"] = _attention(timer, ops, shape, max_chunk)
        body = [g for g in groups if not g.lm_head]
        if body:
            picked = chosen()
            routing = {field: picked[name] for name, field in ROUTING_FIELDS.items() if name in picked}
            series["long_prefill_token_threshold"] = _chunks(timer, ops, body, max_chunk, routing)
        _later_rounds(list(series.values()))
    return {name: s.out for name, s in series.items()}


# setting name -> LinearRouting field
ROUTING_FIELDS = {"cpu_gemv_max_rows": "gemv_max_rows", "int4_gemv_m_threshold": "int4_gemv_m_threshold",
                  "int8_gemv_m_threshold": "int8_gemv_m_threshold",
                  "cpu_upcast_min_rows": "upcast_min_rows", "cpu_bf16_dot_min_rows": "bf16_dot_rows",
                  "cpu_bf16_pair_max_rows": "bf16_pair_max_rows", "cpu_sdpa_min_tokens": "sdpa_min_tokens"}


# ---- the cache ----

def cache_path(cache_dir: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / "calibration" / f"{key}.json"


def read_cached(path: Path, key: str) -> Calibration | None:
    """The stored calibration, or None when there is none or it does not check out."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT_VERSION or data.get("key") != key:
            return None
        values = {str(k): int(v) for k, v in data["values"].items()}
        if any(v < 0 for v in values.values()):
            return None
        return Calibration(key, data["host"], data["measurements"], values, float(data["seconds"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("Calibration %s unreadable (%s): measuring again", path, exc)
        return None


def write_cached(path: Path, calibration: Calibration) -> None:
    """Written to a temporary file renamed into place; a failure to write is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp", suffix=".json", delete=False) as fh:
            json.dump(calibration.to_json(), fh, indent=1)
        os.replace(fh.name, path)
    except OSError as exc:
        log.warning("Calibration not stored at %s (%s): the next start measures again", path, exc)


def calibrate(model: torch.nn.Module, ops: Any, isa: CpuIsa, *, cache_dir: str, max_chunk: int, max_rows: int,
              refresh: bool = False, budget_s: float = BUDGET_S,
              measure_fn: Callable[..., dict] = measure) -> Calibration | None:
    """The host's calibration for this model: stored, or measured now (``refresh``: always
    measured). None, with a warning, when it cannot be measured: the built-in values stand.
    ``max_chunk``: the most tokens a step prefills; ``max_rows``: the most positions it samples."""
    groups = layer_groups(model)
    host = host_identity(isa)
    key = calibration_key(host, model_identity(groups, ops, max_chunk, max_rows))
    path = cache_path(cache_dir, key)
    if not refresh:
        cached = read_cached(path, key)
        if cached is not None:
            log.info("Calibration: %s (measured %s on this host; anna tune measures again)",
                     _describe(cached.values), path)
            return cached
    t0 = time.perf_counter()
    try:
        measurements = measure_fn(model, ops, max_chunk=max_chunk, budget_s=budget_s, max_rows=max_rows)
        values = choose(measurements)
    except Exception as exc:  # (a kernel that cannot run here, a shape torch refuses: serve on the built-ins)
        log.warning("Calibration failed (%s: %s): the built-in values stand", type(exc).__name__, exc)
        return None
    calibration = Calibration(key, host, measurements, values, round(time.perf_counter() - t0, 3))
    write_cached(path, calibration)
    log.info("Calibration measured in %.1f s on %s: %s (stored at %s)", calibration.seconds, isa.model_name,
             _describe(values), path)
    return calibration


def _describe(values: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(values.items())) or "nothing applies to this model"


def report(calibration: Calibration) -> str:
    """The measurements and the values they gave, as ``anna tune`` prints them."""
    lines = [f"Calibration {calibration.key} ({calibration.seconds:.1f} s) on {calibration.host['cpu']}, "
             f"{calibration.host['threads']} threads, kernel level {calibration.host['isa']}"]
    paths = {"cpu_bf16_dot_min_rows": ("kernel on bf16 dot products", "kernel in fp32"),
             "cpu_bf16_pair_max_rows": ("kernel widening in registers", "kernel converting blocks"),
             "cpu_gemv_max_rows": ("Anna's weight-streaming kernel", "the large-M GEMM"),
             "int4_gemv_m_threshold": ("packed int4 kernel", "dequantized GEMM"),
             "int8_gemv_m_threshold": ("packed int8 kernel", "dequantized GEMM"),
             "cpu_upcast_min_rows": ("torch half matmul", "fp32 on the converted weight"),
             "cpu_sdpa_min_tokens": ("Anna's attention kernel", "torch's SDPA")}
    for name, m in calibration.measurements.items():
        value = calibration.values.get(name, "(no data: the built-in value)")
        lines.append(f"{name} = {value}")
        if name in paths:
            kernel, other = paths[name]
            axis = "tokens" if name == "cpu_sdpa_min_tokens" else "M"
            lines.append(f"  {axis:>6}  {kernel + ' ms':>32}  {other + ' ms':>30}")
            lines += [f"  {r:>6}  {k * 1e3:>32.2f}  {o * 1e3:>30.2f}"
                      for r, k, o in zip(m["rows"], m["kernel_s"], m["other_s"])]
        else:
            lines.append(f"  {'tokens':>6}  {'matmul ms per chunk':>22}  {'ms per token':>14}")
            lines += [f"  {n:>6}  {t * 1e3:>22.1f}  {t * 1e3 / n:>14.3f}" for n, t in zip(m["tokens"], m["seconds"])]
    return "\n".join(lines)
