"""What a prompt-attention kernel on AMX bf16 tiles would gain over torch's SDPA here: builds
amx_attention_probe.c (a prototype: D = 64, a prompt over itself), checks it against attention in
fp64 next to SDPA in bf16, then times both on one layer of the Qwen2.5-0.5B shape (14 query heads,
2 KV heads), alternated, each as Anna would call it (fp32 in Anna's layout in, fp32 out).

    python benchmarks/amx_attention_probe.py --tokens 512 2048 --repeats 7
    python benchmarks/amx_attention_probe.py --variant fast_exp    # or tiles_only (see the .c file)

Needs a CPU with amx_bf16 and a compiler with -mamx-bf16 (GCC 11+, Clang 12+).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from anna.model.attention import sdpa_attention
from anna.platforms.cpu.isa import detect_isa

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "src/anna/platforms/cpu/csrc"
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
         "-mavx512dq", "-mavx512vl", "-mamx-tile", "-mamx-bf16"]


VARIANTS = {"full": [], "fast_exp": ["-DPROBE_FAST_EXP"], "tiles_only": ["-DPROBE_TILES_ONLY"]}


def build(out_dir: Path, variant: str = "full") -> ctypes.CDLL:
    library = out_dir / "amx_attention_probe.so"
    subprocess.run(["cc", *FLAGS, *VARIANTS[variant], f"-I{CSRC}", str(HERE / "amx_attention_probe.c"), "-o",
                    str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    p, n = ctypes.c_void_p, ctypes.c_long
    lib.probe_amx_attention.argtypes = [p, p, p, p, n, n, n, ctypes.c_float, ctypes.c_int]
    if lib.probe_request_amx() != 0:
        raise SystemExit("Linux refused the AMX tile state")
    return lib


def probe(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    lib.probe_amx_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1],
                            k.shape[1], scale, torch.get_num_threads())
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return sdpa_attention(q.double(), k.double(), v.double(), scale, None, torch.float64).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--variant", default="full", choices=list(VARIANTS),
                    help="tiles_only computes no softmax: its results are not checked")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/amx_attention_probe.json"))
    args = ap.parse_args()
    heads, kv_heads, dim, scale = 14, 2, 64, 64 ** -0.5
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp), args.variant)
        torch.manual_seed(0)
        errors = {}
        for t in (1, 15, 17, 100, 517):  # rows and keys that fill no block, and several blocks
            q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
            want = reference(q, k, v, scale)
            errors[t] = {"probe": (probe(lib, q, k, v, scale) - want).abs().max().item(),
                         "sdpa_bf16": (sdpa_attention(q, k, v, scale, None, torch.bfloat16) - want).abs().max().item()}
            print(f"T={t}: max |error| against fp64: probe {errors[t]['probe']:.4f}, SDPA bf16 {errors[t]['sdpa_bf16']:.4f}")
            if args.variant != "tiles_only" and errors[t]["probe"] > 2 * errors[t]["sdpa_bf16"] + 1e-3:
                raise SystemExit("the probe is wrong")
        timings = {}
        for t in args.tokens:
            q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
            runs: dict[str, list[float]] = {"probe": [], "sdpa_bf16": []}
            for i in range(args.repeats + 2):  # alternated; the first two are warm-ups
                for name, fn in (("probe", lambda: probe(lib, q, k, v, scale)),
                                 ("sdpa_bf16", lambda: sdpa_attention(q, k, v, scale, None, torch.bfloat16))):
                    t0 = time.perf_counter()
                    fn()
                    if i >= 2:
                        runs[name].append((time.perf_counter() - t0) * 1000)
            timings[t] = {name: round(statistics.median(ms), 2) for name, ms in runs.items()}
            print(f"T={t}: probe {timings[t]['probe']} ms, SDPA bf16 {timings[t]['sdpa_bf16']} ms (median of {args.repeats})")
    isa = detect_isa()
    result = {"variant": args.variant, "cpu": isa.model_name, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "max_abs_error": errors, "ms": timings}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
