#!/usr/bin/env bash
# The CPU benchmark of docs/BENCHMARKS.md ("CPU instruction sets"), on whatever machine this runs:
# prefill (512 and 2,048 tokens), batch-1 decode and 16 streams, bf16 and int4, on the
# Qwen2.5-0.5B-shape model, Anna against llama.cpp built on the same machine, one after the other
# in one run. Anna's prefill also runs forced down to --cpu-isa avx2 (the path before AVX-512
# and AMX were used) and reports the fraction of the model's torch matmul ceiling it reaches.
#
#   python benchmarks/make_random_model.py --out benchmarks/models/qwen2.5-0.5b
#   python benchmarks/export_gguf.py ...            # the F16 GGUF; llama-quantize ... Q4_0 for the Q4_0 one
#   LLAMA_BIN=/path/llama.cpp/build/bin LLAMA_Q4_BIN=/path/llama.cpp/build-noamx/bin \
#   LLAMA_SERVER_BIN=/path/llama.cpp/build-noamx/bin F16=qwen2.5-0.5b-f16.gguf Q4=qwen2.5-0.5b-q4_0.gguf \
#       bash benchmarks/cpu_isa_pairs.sh benchmarks/results/isa/run1
#
# LLAMA_Q4_BIN: the build that runs Q4_0 here (on AMX Xeons the native build dies with an illegal
# instruction on Q4_0: build it with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16). Every result is
# a file under the output folder; the CPU's name and flags are in cpu.txt.
#
# ROUNDS (default 3): rounds of the serving step; the summary gives each round's ratios and their
# median.
#
# THREADS (default: every CPU this process may use): llama.cpp's -t, and Anna's threads through
# OMP_NUM_THREADS, which sets torch's thread count that Anna's kernels follow.
#
# CPU_ISA (default auto): the --cpu-isa every Anna run uses. With CPU_ISA=avx2, torch held to AVX2
# too and a llama.cpp built for AVX2 alone, the run stands for an AVX2-only CPU with this core:
#   CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
#   LLAMA_BIN=/path/llama.cpp/build-avx2/bin ... bash benchmarks/cpu_isa_pairs.sh benchmarks/results/isa/avx2_run1
# (llama.cpp: cmake -B build-avx2 -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
set -euo pipefail
OUT=${1:?output folder}
MODEL=${MODEL:-benchmarks/models/qwen2.5-0.5b}
LLAMA_BIN=${LLAMA_BIN:?llama.cpp bin folder}
LLAMA_Q4_BIN=${LLAMA_Q4_BIN:-$LLAMA_BIN}
LLAMA_SERVER_BIN=${LLAMA_SERVER_BIN:-$LLAMA_BIN}
F16=${F16:?F16 GGUF}
Q4=${Q4:?Q4_0 GGUF}
STEPS=${STEPS:-prefill decode streams}
CPU_ISA=${CPU_ISA:-auto}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$THREADS
mkdir -p "$OUT"
{ grep -m1 "model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo; nproc; echo "THREADS=$THREADS CPU_ISA=$CPU_ISA" \
  "ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-} ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-}" \
  "MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-}"; } > "$OUT/cpu.txt"

for step in $STEPS; do
  case $step in
  prefill)
    for n in 512 2048; do
      for isa in $(printf '%s\n' "$CPU_ISA" avx2 | uniq); do
        python benchmarks/prefill_bench.py --model "$MODEL" --prompt-tokens $n --cpu-isa $isa \
          --out "$OUT/prefill_bf16_${n}_${isa}.json" > "$OUT/prefill_bf16_${n}_${isa}.log" 2>&1
      done
      python benchmarks/prefill_bench.py --model "$MODEL" --prompt-tokens $n --quantization int4 --cpu-isa $CPU_ISA \
        --out "$OUT/prefill_int4_${n}_${CPU_ISA}.json" > "$OUT/prefill_int4_${n}_${CPU_ISA}.log" 2>&1
      "$LLAMA_BIN/llama-bench" -m "$F16" -t $THREADS -p $n -n 0 -r 2 -o json > "$OUT/llamacpp_prefill_f16_$n.json"
      "$LLAMA_Q4_BIN/llama-bench" -m "$Q4" -t $THREADS -p $n -n 0 -r 2 -o json > "$OUT/llamacpp_prefill_q4_0_$n.json"
    done ;;
  decode)
    for q in none int4; do
      python benchmarks/decode_bench.py --model "$MODEL" --prompt-tokens 64 --new-tokens 128 --repeats 3 \
        --no-transformers --device cpu --quantization $q --cpu-isa $CPU_ISA --out "$OUT/decode_$q.json" > "$OUT/decode_$q.log" 2>&1
    done
    "$LLAMA_BIN/llama-bench" -m "$F16" -t $THREADS -p 0 -n 128 -r 3 -o json > "$OUT/llamacpp_decode_f16.json"
    "$LLAMA_Q4_BIN/llama-bench" -m "$Q4" -t $THREADS -p 0 -n 128 -r 3 -o json > "$OUT/llamacpp_decode_q4_0.json"
    ;;
  streams)
    # One server per engine and format; in each of ROUNDS rounds every server answers 1 stream, then
    # 16, a few seconds apart, so each round's ratios compare runs under the same machine speed
    # (a shared VM's memory bandwidth moves the single stream by a third within minutes).
    for round in $(seq 1 $ROUNDS); do
      for q in none int4; do
        anna serve --model "$MODEL" --device cpu --quantization $q --cpu-isa $CPU_ISA --max-num-seqs 16 --port 8000 \
          --served-model-name qwen --log-level warning >> "$OUT/anna_serve_$q.log" 2>&1 &
        pid=$!
        for streams in 1 16; do
          python benchmarks/server_streams.py --base-url http://127.0.0.1:8000 --model qwen --streams $streams \
            > "$OUT/streams_anna_${q}_${streams}_r$round.json"
        done
        kill $pid; wait $pid || true
      done
      for gguf in "$F16" "$Q4"; do
        name=$([ "$gguf" = "$F16" ] && echo f16 || echo q4_0)
        for streams in 1 16; do
          "$LLAMA_SERVER_BIN/llama-server" -m "$gguf" -t $THREADS -np $streams -c $((streams * 256)) -b 2048 -ub 512 \
            --port 8081 >> "$OUT/llama_server_${name}_$streams.log" 2>&1 &
          pid=$!
          python benchmarks/server_streams.py --base-url http://127.0.0.1:8081 --model qwen --streams $streams \
            > "$OUT/streams_llamacpp_${name}_${streams}_r$round.json"
          kill $pid; wait $pid || true
        done
      done
    done ;;
  esac
done
python - "$OUT" "$CPU_ISA" "$STEPS" <<'EOF'
import json, sys
from pathlib import Path
from statistics import median
out, cpu_isa, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split()
def read(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
def llama(name):
    data = read(name)
    return None if not data else data[0]["avg_ts"]
rows = []
for n in (512, 2048):
    for isa in dict.fromkeys((cpu_isa, "avx2")):
        r = read(f"prefill_bf16_{n}_{isa}.json")
        if r:
            rows.append(f"prefill {n} bf16 --cpu-isa {isa} ({r['cpu_isa']}): {r['prefill_tok_s']} tok/s, matmul ceiling "
                        f"{r['matmul_ceiling_tok_s']} tok/s, fraction {r['fraction']}")
    r = read(f"prefill_int4_{n}_{cpu_isa}.json")
    if r:
        rows.append(f"prefill {n} int4: {r['prefill_tok_s']} tok/s")
    if "prefill" in steps:
        rows.append(f"prefill {n} llama.cpp F16: {llama(f'llamacpp_prefill_f16_{n}.json')} tok/s, "
                    f"Q4_0: {llama(f'llamacpp_prefill_q4_0_{n}.json')} tok/s")
for q in ("none", "int4"):
    r = read(f"decode_{q}.json")
    if r:
        rows.append(f"decode batch 1 Anna {q}: {r['anna']['decode_tok_s']:.1f} tok/s")
if "decode" in steps:
    rows.append(f"decode batch 1 llama.cpp F16: {llama('llamacpp_decode_f16.json')}, "
                f"Q4_0: {llama('llamacpp_decode_q4_0.json')}")
def rounds(who, streams):
    found = sorted(out.glob(f"streams_{who}_{streams}_r*.json"), key=lambda p: int(p.stem.rsplit("_r", 1)[1]))
    return [read(p.name)["best_aggregate_tok_s"] for p in found]
def ratios(num, den):
    return [a / b for a, b in zip(num, den)]
def show(values, fmt):
    return ", ".join(fmt.format(v) for v in values) + f" (median {fmt.format(median(values))})"
for who in ("anna_none", "anna_int4", "llamacpp_f16", "llamacpp_q4_0"):
    for s in (1, 16):
        if r := rounds(who, s):
            rows.append(f"streams {who} x{s}, each round: {show(r, '{:.2f}')} tok/s")
for q, peer in (("none", "f16"), ("int4", "q4_0")):
    one, sixteen, peer16 = rounds(f"anna_{q}", 1), rounds(f"anna_{q}", 16), rounds(f"llamacpp_{peer}", 16)
    if one and sixteen:
        rows.append(f"streams anna_{q} x16 / own x1, each round: {show(ratios(sixteen, one), '{:.2f}x')}")
    if sixteen and peer16:
        rows.append(f"streams anna_{q} x16 / llamacpp_{peer} x16, each round: {show(ratios(sixteen, peer16), '{:.2f}x')}")
(out / "summary.txt").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
