"""Builds a C library with the system compiler, once per source, flags, compiler and CPU, into
`~/.cache/coreserve/kernels/` (engine-core process; the benchmark probes use it too), and compiles the
wheel's prebuilt variants (`compile_library`, called by prebuild.py at wheel-build time).

The first-use build uses -march=native, so the key holds the CPU's features: a home shared between
machines never shares builds. A build goes to a temporary name and is renamed, so processes building
at once never load half a file. This module imports only the standard library (setup.py runs it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

NATIVE = ("-march=native",)  # the first-use build's target; a prebuilt variant names its level instead
# extra_flags that build the kernels as for a CPU with less: without AVX-512 (an AVX2 CPU), then without
# AVX2 and FMA, then without any vector extension (the tests' and bench_quant_gemv.py's narrower builds)
NARROWER_BUILDS = {
    "avx2": ("-mno-avx512f",),
    "avx": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
    "generic": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avx", "-mno-f16c"),
}
# gcc tuned for AMD Zen (-march=native there) leaves a chain of multiply-adds up to 256 bits wide as a
# multiply and an add (shorter latency on Zen); the kernels' fixed order is fused multiply-adds on every
# CPU, and gemv_quant.c's intrinsics fuse, so gcc is told to keep every chain fused.
GCC_FLAGS = ("--param=avoid-fma-max-bits=0",)
# Defined for a second try when the first fails: an assembler too old for AMX builds the rest.
FALLBACK_DEFINE = "-DCORESERVE_NO_AMX"
# One compiler run's limit: a hung compiler fails the build, a loaded host's slow one does not (gemv_quant.c
# at -march=x86-64-v3 takes tens of seconds of CPU with gcc 12, and a busy host stretches that).
COMPILE_TIMEOUT_S = 900


def find_compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def load_library(
    name: str,
    sources: list[Path],
    headers: list[Path],
    compiler: str,
    cache_dir: Path | None = None,
    extra_flags: tuple[str, ...] = (),
    target: tuple[str, ...] = NATIVE,
) -> ctypes.CDLL:
    """The built library, loaded (built first where it is missing or damaged). extra_flags: after the
    usual ones (the tests narrow the instruction set with them, e.g. `-mno-avx512f`); target: the
    instruction set, -march=native or a variant's level (kernel_variants.py). Raises OSError,
    RuntimeError or subprocess.SubprocessError when it cannot be built or loaded."""
    version = compiler_version(compiler)
    flags = (*compile_flags(version, target), *extra_flags)
    library = _library_path(name, sources + headers, version, flags, cache_dir)
    if not library.exists():
        compile_library(compiler, sources, library, flags)
    try:
        return ctypes.CDLL(str(library))
    except OSError:  # a damaged cached build: rebuild it once
        library.unlink(missing_ok=True)
        compile_library(compiler, sources, library, flags)
        return ctypes.CDLL(str(library))


def compiler_version(compiler: str) -> bytes:
    return subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout


def compile_flags(version: bytes, target: tuple[str, ...]) -> tuple[str, ...]:
    """The build's flags for the compiler whose `--version` this is (clang has no such --param)."""
    flags = ("-O3", *target, "-fopenmp", "-shared", "-fPIC", "-std=c11")
    return flags if b"clang" in version.lower() else flags + GCC_FLAGS


def compile_library(
    compiler: str, sources: list[Path], library: Path, flags: tuple[str, ...], link_openmp: bool = True
) -> None:
    """Builds library from sources with flags. link_openmp False: compiled with the OpenMP pragmas but
    linked without libgomp, its GOMP_* and omp_* symbols left for the runtime the process has already
    loaded (torch's, in the global scope: the wheel's variants, which then need no bundled runtime)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        if link_openmp:
            _run_with_fallback([compiler, *flags, *map(str, sources), "-o", tmp, "-lm"], library)
        else:
            with tempfile.TemporaryDirectory(dir=library.parent) as objects:
                _run_with_fallback([compiler, *flags, "-c", *(str(s.resolve()) for s in sources)], library, objects)
                linked = [compiler, "-shared", "-fPIC", *sorted(map(str, Path(objects).glob("*.o"))), "-o", tmp, "-lm"]
                subprocess.run(linked, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        os.chmod(tmp, 0o755)
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _run_with_fallback(command: list[str], library: Path, cwd: str | None = None) -> None:
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S, cwd=cwd)
    except subprocess.CalledProcessError as exc:
        logger.warning("building %s again with %s: %s", library.name, FALLBACK_DEFINE,
                       exc.stderr.decode(errors="replace")[-500:])
        subprocess.run([*command, FALLBACK_DEFINE], check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S, cwd=cwd)


def _library_path(
    name: str, files: list[Path], version: bytes, flags: tuple[str, ...], cache_dir: Path | None
) -> Path:
    digest = hashlib.sha256(" ".join(flags).encode() + version + _cpu_signature())
    for file in files:
        digest.update(file.read_bytes())
    folder = cache_dir or Path.home() / ".cache" / "coreserve" / "kernels"
    return folder / f"{name}-{digest.hexdigest()[:16]}.so"


def _cpu_signature() -> bytes:
    """The CPU's feature list (x86 `flags`, arm `Features`), or its machine name where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    features = [line for line in lines if line.startswith(("flags", "Features"))]
    return (features[0] if features else f"{platform.machine()} {platform.processor()}").encode()
