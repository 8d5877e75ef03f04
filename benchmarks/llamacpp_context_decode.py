"""llama.cpp's batch-1 decode speed after a long context, per KV cache type (-ctk/-ctv), measured
through llama-server so that the decode is timed on its own.

    python benchmarks/llamacpp_context_decode.py --server llama.cpp/build/bin/llama-server \
        --model qwen2.5-0.5b-f16.gguf --context 32728 --cache-types q4_0 q8_0

Each cache type starts one server (flash attention on, one slot, --threads). llama.cpp's CPU
prefill slows with the square of the context, more so with quantized KV: a real 32K prefill of the
0.5B-shape model with q4_0 KV had processed 16,384 tokens after 36 minutes on a 2-core Zen 4. So by
default the context is built from a shorter real one: --seed-tokens seeded random ids are prefilled
(n_predict 1), the slot is saved (llama-server's /slots?action=save), and its file is rewritten to
hold --context cells - the seed's own stored K/V rows (llama.cpp's quantized bytes) repeated, at
positions 0 .. context - 1 - and restored into the slot. A decode step's attention then reads
--context cells of the chosen type, as after a real prefill (the work per cell does not depend on
the values). --seed-tokens 0 prefills the whole context instead. Then the context's ids are sent
again with n_predict --new-tokens and ignore_eos: the slot reuses them, so the response's
`timings.predicted_per_second` is decode after --context tokens. Output: JSON, one entry per cache
type (each also on stderr as it ends).
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from soak import free_port, wait_healthy  # (benchmarks/ is on the path when this runs as a script)

STATE_MAGIC, STATE_VERSION = 0x67677371, 3  # llama.h: LLAMA_STATE_SEQ_MAGIC ('ggsq'), LLAMA_STATE_SEQ_VERSION


def read_state(path: Path) -> dict:
    """A llama.cpp sequence state file (llama_state_seq_save_file, version 3) of one stream whose
    cells each belong to one sequence: the cells' positions and each layer's K and V rows."""
    buf = path.read_bytes()
    off = 0

    def take(fmt: str) -> tuple:
        nonlocal off
        vals = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return vals

    magic, version, n_tokens = take("<III")
    if (magic, version) != (STATE_MAGIC, STATE_VERSION):
        raise ValueError(f"{path}: not a version-{STATE_VERSION} llama.cpp sequence state")
    off += 4 * n_tokens
    n_stream, cells = take("<II")
    if n_stream != 1:
        raise ValueError(f"{path}: {n_stream} streams")
    for _ in range(cells):
        _pos, n_seq = take("<iI")
        if n_seq != 1:
            raise ValueError(f"{path}: a cell of {n_seq} sequences")
        off += 4
    v_trans, n_layer = take("<II")
    if v_trans:
        raise ValueError(f"{path}: transposed V (flash attention off)")
    layers = {"k": [], "v": []}
    for kind in ("k", "v"):
        for _ in range(n_layer):
            type_id, row = take("<iQ")
            layers[kind].append((type_id, row, buf[off:off + cells * row]))
            off += cells * row
    if off != len(buf):
        raise ValueError(f"{path}: {len(buf) - off} bytes left unread")
    return {"cells": cells, "layers": layers}


def write_repeated_state(seed: dict, tokens: list[int], path: Path) -> None:
    """A state of len(tokens) cells at positions 0 .. n - 1, cell i holding the seed's rows of cell i % seed cells."""
    n, cells = len(tokens), seed["cells"]
    reps = -(-n // cells)
    with path.open("wb") as f:
        f.write(struct.pack("<III", STATE_MAGIC, STATE_VERSION, n))
        f.write(struct.pack(f"<{n}i", *tokens))
        f.write(struct.pack("<II", 1, n))
        for pos in range(n):
            f.write(struct.pack("<iIi", pos, 1, 0))
        f.write(struct.pack("<II", 0, len(seed["layers"]["k"])))
        for kind in ("k", "v"):
            for type_id, row, data in seed["layers"][kind]:
                f.write(struct.pack("<iQ", type_id, row))
                f.write((data * reps)[:n * row])


def measure(args: argparse.Namespace, cache_type: str, slot_dir: Path) -> dict:
    port = free_port()
    cmd = [args.server, "-m", args.model, "-t", str(args.threads), "--port", str(port), "-np", "1",
           "-c", str(args.context + args.new_tokens + 8), "-fa", "on", "-ctk", cache_type, "-ctv", cache_type,
           "-b", "2048", "-ub", "512", "--slot-save-path", f"{slot_dir}/"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rng = random.Random(args.seed)
    try:
        base = f"http://127.0.0.1:{port}"
        if not wait_healthy(server, base, timeout_s=600):
            raise RuntimeError(f"llama-server did not start (exit code {server.returncode})")
        with httpx.Client(base_url=base, timeout=None) as http:
            real = args.seed_tokens <= 0 or args.seed_tokens >= args.context
            first = [rng.randrange(args.min_token, args.max_token)
                     for _ in range(args.context if real else args.seed_tokens)]
            t0 = time.perf_counter()
            http.post("/completion", json={"prompt": first, "n_predict": 1, "cache_prompt": True,
                                           "temperature": 0}).raise_for_status()
            prefill_s = time.perf_counter() - t0
            prompt = first
            if not real:
                http.post("/slots/0?action=save", json={"filename": "seed.bin"}).raise_for_status()
                seed = read_state(slot_dir / "seed.bin")
                prompt = [first[i % seed["cells"]] for i in range(args.context)]
                write_repeated_state(seed, prompt, slot_dir / "context.bin")
                http.post("/slots/0?action=restore", json={"filename": "context.bin"}).raise_for_status()
            body = {"prompt": prompt, "n_predict": args.new_tokens, "ignore_eos": True, "cache_prompt": True,
                    "temperature": 0}
            timings = http.post("/completion", json=body).raise_for_status().json()["timings"]
    finally:
        server.terminate()
        server.wait()
    if timings["prompt_n"] > 1:
        raise RuntimeError(f"the context was not reused: {timings['prompt_n']} prompt tokens processed again")
    return {"cache_type": cache_type, "context": args.context,
            "context_from": "a real prefill" if real else f"{args.seed_tokens} prefilled tokens' cells repeated",
            "prefill_s": round(prefill_s, 1), "decode_tokens": timings["predicted_n"],
            "decode_tok_s": round(timings["predicted_per_second"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True, help="the llama-server binary")
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--context", type=int, default=32728, help="tokens of context (default: the 32K pairs' prompt)")
    ap.add_argument("--seed-tokens", type=int, default=2048, help="the real prefill the context is built from (0: all)")
    ap.add_argument("--cache-types", nargs="+", default=["f16", "q8_0", "q4_0"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-token", type=int, default=100, help="prompt ids are drawn from [min, max)")
    ap.add_argument("--max-token", type=int, default=700)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as slot_dir:
        for cache_type in args.cache_types:
            results.append(measure(args, cache_type, Path(slot_dir)))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"model": args.model, "threads": args.threads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
