#!/usr/bin/env bash
# The KV cache benchmark of docs/BENCHMARKS.md ("KV cache dtypes"), on whatever machine this runs:
# Anna's decode attention per KV cache dtype (the kernel alone), batch-1 decode at 512, 8K and 32K
# tokens of context and 16 streams at 4K through the engine, capacity in a 1 GiB budget, a repeated
# 2,048-token prompt served by prefix blocks and by the exact prompt cache, and
# llama.cpp on the same model with -ctk/-ctv f16, q8_0 and q4_0 at the same contexts (32K: q4_0 and
# q8_0, benchmarks/llamacpp_context_decode.py), one after the other in one run.
#
#   python benchmarks/make_random_model.py --out benchmarks/models/qwen2.5-0.5b
#   python benchmarks/export_gguf.py ...            # the F16 GGUF of the same model
#   LLAMA_BIN=/path/llama.cpp/build/bin F16=qwen2.5-0.5b-f16.gguf \
#       bash benchmarks/kv_cache_pairs.sh benchmarks/results/kv_cache/run1
#
# Every result is a file under the output folder; the CPU's name and flags are in cpu.txt.
set -euo pipefail
OUT=${1:?output folder}
MODEL=${MODEL:-benchmarks/models/qwen2.5-0.5b}
LLAMA_BIN=${LLAMA_BIN:?llama.cpp bin folder}
F16=${F16:?F16 GGUF}
TYPES=${TYPES:-float32 bfloat16 int8 fp8_e4m3 turboquant4 turboquant3}  # float32: the baseline (auto on CPU)
LONG_TYPES=${LONG_TYPES-float32 turboquant4}  # at 32K (each prefills 32K tokens; empty: skipped)
STEPS=${STEPS:-kernel anna llamacpp}
LLAMA_DEPTHS=${LLAMA_DEPTHS:-512,8192}  # llama-bench prefills each depth first, for every repetition
LLAMA_LONG_TYPES=${LLAMA_LONG_TYPES-q4_0 q8_0}  # at 32K, through llama-server (one prefill each, over 30 min here)
LLAMA_TYPES=${LLAMA_TYPES:-f16 q8_0 q4_0}
LLAMA_STREAM_TYPES=${LLAMA_STREAM_TYPES:-f16 q8_0 q4_0}
mkdir -p "$OUT"
{ grep -m1 "model name" /proc/cpuinfo; grep -m1 "^flags" /proc/cpuinfo; nproc; } > "$OUT/cpu.txt"

for step in $STEPS; do
  case $step in
    kernel)
      python benchmarks/attention_bench.py --contexts 512 8192 32768 --seqs 1 --pool-blocks 2048 \
        --kv-cache-dtypes $TYPES > "$OUT/attention_batch1.json"
      python benchmarks/attention_bench.py --contexts 4096 --seqs 16 --kv-cache-dtypes $TYPES \
        > "$OUT/attention_16x4k.json" ;;
    anna)
      python benchmarks/kv_cache_bench.py --model "$MODEL" --contexts 512 8192 --kv-cache-dtypes $TYPES \
        --streams 16 --stream-context 4096 --repeat-prompt 2048 --out "$OUT/anna_512_8k_streams.json"
      if [ -n "$LONG_TYPES" ]; then  # bf16 weights, then int4 (where the KV's share of a step is larger)
        for q in none int4; do
          python benchmarks/kv_cache_bench.py --model "$MODEL" --quantization $q --contexts 32768 \
            --kv-cache-dtypes $LONG_TYPES --new-tokens 24 --out "$OUT/anna_32k_$q.json"
        done
      fi ;;
    llamacpp)
      for t in $LLAMA_TYPES; do
        "$LLAMA_BIN/llama-bench" -m "$F16" -t 2 -p 0 -n 32 -d "$LLAMA_DEPTHS" -fa 1 -ctk $t -ctv $t -r 1 -o json \
          > "$OUT/llamacpp_decode_$t.json"
      done
      if [ -n "$LLAMA_LONG_TYPES" ]; then
        python benchmarks/llamacpp_context_decode.py --server "$LLAMA_BIN/llama-server" --model "$F16" \
          --context 32768 --cache-types $LLAMA_LONG_TYPES > "$OUT/llamacpp_32k.json"
      fi
      for t in $LLAMA_STREAM_TYPES; do  # 16 streams sharing a 4,080-token prompt (-pps), as Anna's
        "$LLAMA_BIN/llama-batched-bench" -m "$F16" -t 2 -c 66560 -b 2048 -ub 512 -npp 4080 -ntg 32 -npl 16 -pps \
          -fa 1 -ctk $t -ctv $t > "$OUT/llamacpp_16x4k_$t.txt" 2>&1
      done ;;
  esac
done
