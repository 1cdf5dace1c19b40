#!/usr/bin/env bash
# Runs every benchmark once, in sequence (they must not share the two cores), logging to bench_out/.
# The figures in docs/benchmarks.md come from one run of this script.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
PY=.venv/bin/python
mkdir -p bench_out
run() { local name=$1; shift; echo "== $name: $*"; "$PY" "$@" 2>&1 | grep --line-buffered -v "Loading weights" | tee "bench_out/$name.log"; }
run wire scripts/bench_wire.py
run decode_step scripts/bench_decode_step.py --model builtin:small --batch 64 --context 256 --steps 12
run decode_step_torch_bf16 scripts/bench_decode_step.py --model builtin:small --batch 64 --context 256 --steps 12 --dtype bfloat16 --no-cpu-kernels --json bench_out/decode_step_torch_bf16.json
run gemv scripts/bench_gemv.py --preset small --rows 1,2,4,8,16,32,64
run decode_step_b1 scripts/bench_decode_step.py --model builtin:small --batch 1 --context 128 --steps 30 --json bench_out/decode_step_b1.json
run decode_step_b1_bf16 scripts/bench_decode_step.py --model builtin:small --batch 1 --context 128 --steps 30 --dtype bfloat16 --json bench_out/decode_step_b1_bf16.json
run dtype scripts/bench_dtype.py --model builtin:small --concurrency 1,32 --rounds 2
run throughput_hf scripts/bench_throughput.py --configs engine,hf --rounds 1 --max-output-len 512 --json bench_out/throughput_hf.json
run throughput_logprobs scripts/bench_throughput.py --configs engine,engine-lp5,engine-lp20,engine-plp5 --rounds 4 --max-output-len 96 --json bench_out/throughput_logprobs.json
run multi_step scripts/bench_multi_step.py --model builtin:tiny --num-requests 64 --output-len 256 --steps 8
run multi_step_core scripts/bench_multi_step.py --model builtin:tiny --num-requests 64 --output-len 256 --steps 8 --core-only
run serving_logprobs scripts/bench_serving.py --num-requests 32 --max-output-len 256 --compare "" "logprobs=5" --out bench_out/serving_logprobs
run serving_mp scripts/bench_serving.py --num-requests 32 --max-output-len 256 --compare "inproc" "" --out bench_out/serving_mp
run prefix_cache scripts/bench_prefix_cache.py --model builtin:small
