#!/usr/bin/env bash
# The checks to run on a machine with an NVIDIA GPU (torch with CUDA and Anna installed):
# the CUDA-marked tests, then decode speed by executor and eager against torch.compile, long-context
# decode per KV cache dtype, and the cost of speculative decoding's verification steps.
#     bash benchmarks/gpu_check.sh [results-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m pytest -m cuda -q -p no:warnings 2>&1 | tee "$out/cuda_tests.txt"
model=benchmarks/models/qwen2.5-0.5b
[ -f "$model/config.json" ] || python benchmarks/make_random_model.py --out "$model"
for executor in eager graph; do
  python benchmarks/decode_bench.py --model "$model" --device cuda --no-transformers \
    --decode-executor "$executor" --out "$out/decode_$executor.json"
done
python benchmarks/compile_bench.py --model "$model" --out "$out/compile.json"
# long-context decode per KV cache dtype (the device is CUDA: LLM's device auto)
python benchmarks/kv_cache_bench.py --model "$model" --contexts 8192 32768 \
  --kv-cache-dtypes auto fp8_e4m3 int8 turboquant4 --out "$out/kv_cache.json"
hybrid=benchmarks/models/qwen3.5-0.8b
[ -f "$hybrid/config.json" ] || python benchmarks/make_random_model.py --shape qwen3.5-0.8b --out "$hybrid"
python benchmarks/decode_bench.py --model "$hybrid" --device cuda --out "$out/decode_qwen3_5.json"
for m in "$model" "$hybrid"; do
  python benchmarks/spec_decode_bench.py verify --model "$m" --device cuda --out "$out/spec_verify_$(basename "$m").json"
done
