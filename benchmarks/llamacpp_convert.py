"""Convert a benchmark model to GGUF with llama.cpp's own converter (the reference that
benchmarks/export_gguf.py is checked against, and the one way to write Qwen3-Next).

    python benchmarks/llamacpp_convert.py --llama-cpp /path/to/llama.cpp \
        --model benchmarks/models/qwen3.5-0.8b --out qwen3.5-0.8b-f16.gguf

llama.cpp's converter identifies a BPE pre-tokenizer by hashing how it splits a test text and
refuses tokenizers it does not know; the benchmark models carry Anna's small demo tokenizer,
which splits like Qwen's, so the converter is told "qwen2". Nothing else is changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="A llama.cpp source tree.")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--outtype", default="f16", choices=["f16", "bf16", "f32", "q8_0"])
    args = ap.parse_args()
    sys.path[:0] = [str(args.llama_cpp), str(args.llama_cpp / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    hybrid = any(a.startswith(("Qwen3_5", "Qwen3Next")) for a in
                 json.loads((args.model / "config.json").read_text()).get("architectures", []))
    sys.argv = ["convert_hf_to_gguf.py", str(args.model), "--outfile", str(args.out), "--outtype", args.outtype,
                *(["--no-mtp"] if hybrid else [])]  # (the random hybrid models have no MTP head)
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
