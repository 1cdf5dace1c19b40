#!/usr/bin/env bash
# Creates .venv and installs coreserve with its test and benchmark extras. Idempotent: a second run
# with nothing changed returns at once (the Makefile only calls it when pyproject.toml is newer).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # A CUDA machine: the default wheel is the CUDA build.
    .venv/bin/python -m pip install -q "torch>=2.4"
  else
    # No GPU: pin the CPU wheel (a plain 'torch' pulls a multi-GB CUDA build).
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
fi
.venv/bin/python -m pip install -q -e ".[test,bench]"
