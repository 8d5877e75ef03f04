"""How long self-calibration's measuring takes on this host, with no budget to cut it short: the
first rounds alone by default (--rounds 1), which must fit the 15 s budget for every setting to be
measured at least once (src/anna/platforms/cpu/calibration.py).

    python benchmarks/calibration_rounds.py --model benchmarks/models/qwen2.5-0.5b --quantization int4

Prints one JSON line: the seconds, the values chosen and the measurements. The model is loaded as
`anna serve` loads it (calibration off, so that the measuring here is the only one), and measured
for --max-num-seqs sampled positions and prefill chunks up to --max-chunk tokens.
"""

from __future__ import annotations

import argparse
import json
import time

from anna import LLM
from anna.platforms.cpu import calibration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every setting's points (serving: 3)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-chunk", type=int, default=2048)
    args = ap.parse_args()

    llm = LLM(args.model, dtype="bfloat16", device="cpu", quantization=args.quantization, calibrate=False,
              inference_warmup=False, max_model_len=args.max_chunk, max_num_seqs=args.max_num_seqs,
              num_gpu_blocks_override=args.max_chunk // 16 + 1)
    model = llm.llm_engine.runner.model
    calibration.ROUNDS = args.rounds
    t0 = time.perf_counter()
    measurements = calibration.measure(model, model.norm.ops, max_chunk=args.max_chunk, budget_s=1e6,
                                       max_rows=args.max_num_seqs)
    seconds = time.perf_counter() - t0
    print(json.dumps({"model": args.model, "quantization": args.quantization, "rounds": args.rounds,
                      "seconds": round(seconds, 2), "values": calibration.choose(measurements),
                      "measurements": measurements}))


if __name__ == "__main__":
    main()
