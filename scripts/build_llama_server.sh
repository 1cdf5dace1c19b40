#!/usr/bin/env bash
# Builds llama.cpp's HTTP server (llama-server) and its quantizer (llama-quantize, which makes the GGUF
# files people download) from the llama.cpp that the llama-cpp-python 0.3.36
# source package on PyPI vendors (the package scripts/setup.sh fetches the vocab files from), for a
# side-by-side run against coreserve on the same GGUF file (docs/quantized.md). The CPU's own
# instruction sets (AVX-512 where it has them; AMX left out, below); no CUDA, no curl.
#
#   scripts/build_llama_server.sh            # -> ~/.cache/coreserve/llama.cpp-0.3.36/build/bin/llama-server
#                                            #    and .../bin/llama-quantize
#   ~/.cache/coreserve/llama.cpp-0.3.36/build/bin/llama-server -m "$(.venv/bin/python -c \
#       'from coreserve.protocol.builtin_model import builtin_model_path; print(builtin_model_path("smollm2"))')" \
#       --port 8081 -t 2 -np 32 -c 16384 --cont-batching
#
# Heavy (minutes of both cores): run it on a quiet machine. Needs cmake and a C++ compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DEST="${LLAMA_CPP_DIR:-$HOME/.cache/coreserve/llama.cpp-$VERSION}"
JOBS="${JOBS:-$(nproc)}"
command -v cmake >/dev/null || { echo "cmake is needed (pip install cmake, or the system's)" >&2; exit 1; }
if [ ! -f "$DEST/CMakeLists.txt" ]; then
  SDIST_TMP=$(mktemp -d)
  trap 'rm -rf "$SDIST_TMP"' EXIT
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SDIST_TMP"
  mkdir -p "$DEST"
  tar -xzf "$SDIST_TMP/llama_cpp_python-$VERSION.tar.gz" -C "$DEST" --strip-components=3 \
    "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
# Native flags, except on a CPU with AMX tiles: there llama.cpp's AMX matrix product crashed
# llama-server in its warm-up (SIGSEGV in ggml_backend_amx_mul_mat, an Intel Xeon under KVM,
# 2026-12-04), so that build names the CPU's AVX-512 / AVX2 features one by one and leaves AMX out.
CPU_FLAGS=()
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
  CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
    -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX512="$(has avx512f)"
    -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
    -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)")
else
  CPU_FLAGS=(-DGGML_NATIVE=ON)
fi
cmake -S "$DEST" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release "${CPU_FLAGS[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build "$DEST/build" --target llama-server llama-quantize -j "$JOBS"
echo "built $DEST/build/bin/llama-server and $DEST/build/bin/llama-quantize"
