"""Which x86 instruction sets this CPU has, and the one kernel level Anna runs at: read once at
start from /proc/cpuinfo, named in the start-up log, and the only place kernels are chosen from.

Levels, each including the one before: avx2 (avx2 + fma + f16c: Anna's C kernels), avx512 (F,
BW, DQ, VL), avx512_vnni (int8 dot products), avx512_bf16 (bf16 dot products), amx (AMX tiles for
bf16 and int8). What a level changes: from avx512 on, Anna's kernels are built with AVX-512 (the
weight-streaming matmul in 512-bit vectors), from avx512_vnni on they run the int8/int4 dot
products on vpdpbusd (kernels.py: LEVEL_CFLAGS); from avx512_bf16 on,
a bf16 model's matmuls of many rows (prefill, batched decode) run as bf16 matmuls in oneDNN,
which uses AVX512-BF16 or AMX (Linux's AMX permission request is oneDNN's own), instead of
converting the weights to fp32, its gated MLP keeps its intermediate rows in bf16, its
prefill attention runs in bf16, and Anna's weight-streaming kernel multiplies its bf16 weights on
vdpbf16ps from cpu_bf16_dot_min_rows rows of x on (the routing passes that to each call; the
instruction is compiled into the AVX-512 builds as a function target, run only at this level);
at amx, the kernels are built with AMX too and run int4 and int8 matmuls of 16 rows of x or more on
int8 tiles (csrc/amx_tiles.h; Linux's permission is asked for before they are built, and the built
tiles must pass a self-check in a child process, their results against the avx512_vnni path's on
fixed data; a refusal or a failed check falls back to the avx512_vnni build, with a warning).
``--cpu-isa`` forces a lower level (an AMX machine then runs the AVX2 path); forcing one the CPU
lacks is refused at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# level -> the /proc/cpuinfo flags it needs on top of the levels before it
LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "avx512_vnni": ("avx512_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
LEVELS = tuple(LEVEL_FLAGS)
NONE = "none"  # not even AVX2: torch's kernels only


@dataclass(frozen=True)
class CpuIsa:
    model_name: str
    flags: frozenset[str]
    available: str  # the highest level the CPU has (NONE below avx2)
    level: str  # the level Anna runs at: the available one, or a lower one forced by --cpu-isa

    def has(self, level: str) -> bool:
        """Whether Anna runs at ``level`` or above."""
        return self.level != NONE and LEVELS.index(self.level) >= LEVELS.index(level)

    @property
    def bf16_matmul(self) -> bool:
        """bf16 matmuls run in hardware bf16 (AVX512-BF16 or AMX) rather than through fp32."""
        return self.has("avx512_bf16")

    def describe(self) -> str:
        shown = " ".join(flag for level in LEVELS for flag in LEVEL_FLAGS[level] if flag in self.flags)
        why = "the highest this CPU has" if self.level == self.available else \
            f"forced by cpu_isa (the CPU has {self.available})"
        return f"CPU: {self.model_name}; instruction sets: {shown or 'none that Anna uses'}; " \
               f"kernel level {self.level} ({why})"


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def detect_isa(cpuinfo: str | None = None, force: str = "auto") -> CpuIsa:
    """The CPU's levels from /proc/cpuinfo's text (the first processor's entry); ``force``: a
    level to run at instead of the highest available (cpu_isa), ValueError if the CPU lacks it."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = frozenset(fields.get("flags", "").split())
    available = NONE
    for level in LEVELS:
        if not all(flag in flags for flag in LEVEL_FLAGS[level]):
            break
        available = level
    model = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']} model {fields['model']})"
    level = available
    if force != "auto":
        if force != NONE and (available == NONE or LEVELS.index(force) > LEVELS.index(available)):
            raise ValueError(f"cpu_isa: this CPU ({model}) has instruction sets up to {available}, not {force}")
        level = force
    return CpuIsa(model, flags, available, level)
