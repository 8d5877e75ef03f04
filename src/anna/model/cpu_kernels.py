"""Anna's compiled CPU kernels (C, AVX2/FMA/F16C), built with the system C compiler on first use
and cached by source hash. Loaded through ctypes, which releases the GIL during each call.
Where no compiler or no AVX2 is available, Anna runs torch's kernels instead (one warning)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "cpu_gemv.c"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
WEIGHT_TYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
MAX_ROWS_PER_PASS = 8  # the kernel reads W once per 8 rows of x


def cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


class CpuGemv:
    """y = x W^T (+ b) for a few rows of x, reading each weight row once for all of them."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        fn = self.lib.anna_gemv
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_int]
        fn.restype = None
        self.fn = fn

    def supports(self, weight: torch.Tensor) -> bool:
        return weight.dtype in WEIGHT_TYPES and weight.is_contiguous() and weight.device.type == "cpu"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        k = x.shape[-1]
        x2 = x.reshape(-1, k).float().contiguous()
        rows, n = x2.shape[0], weight.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32)
        b = None if bias is None else bias.float().contiguous()
        self.fn(x2.data_ptr(), weight.data_ptr(), WEIGHT_TYPES[weight.dtype], None if b is None else b.data_ptr(),
                y.data_ptr(), rows, n, k, torch.get_num_threads())
        return y.view(*x.shape[:-1], n).to(x.dtype)


def build_cpu_gemv(cache_dir: str | Path) -> CpuGemv | None:
    """Compile (once per source version) and load the kernel; None if this machine cannot."""
    if not cpu_has_avx2():
        log.warning("CPU without AVX2/FMA/F16C: using torch's matmul kernels")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out_dir = Path(cache_dir).expanduser() / "kernels"
    library = out_dir / f"anna_cpu_gemv_{digest}.so"
    if not library.exists():
        if compiler is None:
            log.warning("No C compiler found: using torch's matmul kernels (install gcc for faster CPU decode)")
            return None
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True)
            os.replace(tmp, library)
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            log.warning("Could not compile Anna's CPU kernels (%s): using torch's", detail.strip()[:200])
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return CpuGemv(library)
    except OSError as exc:
        log.warning("Could not load Anna's CPU kernels (%s): using torch's", exc)
        return None
