#!/usr/bin/env bash
# docs/BENCHMARKS.md "Pre-quantized checkpoints": the Qwen2.5-0.5B-shape model from its Q4_0 GGUF,
# in one run: load time, batch-1 decode and 16 streams for Anna serving the file, Anna quantizing
# the bf16 safetensors to int4 at load, and llama.cpp on the same file.
#
#   python benchmarks/make_random_model.py --out benchmarks/models/qwen2.5-0.5b
#   python benchmarks/export_gguf.py --model benchmarks/models/qwen2.5-0.5b --out qwen-f16.gguf
#   llama-quantize qwen-f16.gguf qwen-q4_0.gguf Q4_0
#   LLAMA_BIN=/path/llama.cpp/build/bin GGUF=qwen-q4_0.gguf bash benchmarks/gguf_bench.sh benchmarks/results/gguf/run1
#
# PURE (optional): a `llama-quantize --pure` file as well (every matrix Q4_0, the lm_head too).
# llama.cpp's load time is the wall time from starting llama-server to its first healthy /health.
set -euo pipefail
OUT=${1:?output folder}
MODEL=${MODEL:-benchmarks/models/qwen2.5-0.5b}
LLAMA_BIN=${LLAMA_BIN:?llama.cpp bin folder}
GGUF=${GGUF:?Q4_0 GGUF}
mkdir -p "$OUT"
{ grep -m1 "model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo; nproc; } > "$OUT/cpu.txt"

formats="int4,gguf-q4_0=$GGUF${PURE:+,gguf-q4_0-pure=$PURE}"
python benchmarks/quant_bench.py --model "$MODEL" --formats "$formats" --out "$OUT/anna.json" > "$OUT/anna.log" 2>&1

for file in "$GGUF" ${PURE:+"$PURE"}; do
  name=$(basename "$file" .gguf)
  "$LLAMA_BIN/llama-bench" -m "$file" -t 2 -p 0 -n 128 -r 3 -o json > "$OUT/llamacpp_decode_$name.json"
  "$LLAMA_BIN/llama-batched-bench" -m "$file" -t 2 -c 4096 -npp 64 -ntg 128 -npl 16 \
    > "$OUT/llamacpp_batched_16_$name.txt" 2>&1
  for i in 1 2 3; do
    start=$(date +%s.%N)
    "$LLAMA_BIN/llama-server" -m "$file" -t 2 --port 8096 -np 1 > /dev/null 2>&1 &
    pid=$!
    until curl -sf http://127.0.0.1:8096/health > /dev/null; do sleep 0.05; done
    echo "$(date +%s.%N) - $start" | bc >> "$OUT/llamacpp_load_$name.txt"
    kill $pid; wait $pid || true
  done
done
echo "done: $OUT"
