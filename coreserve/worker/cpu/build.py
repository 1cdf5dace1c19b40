"""Builds a C library with the system compiler, once per source, flags, compiler and CPU, into
`~/.cache/coreserve/kernels/` (engine-core process; the benchmark probes use it too).

The build uses -march=native, so the key holds the CPU's features: a home shared between machines
never shares builds. A build goes to a temporary name and is renamed, so processes building at once
never load half a file.
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

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
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


def find_compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def load_library(
    name: str,
    sources: list[Path],
    headers: list[Path],
    compiler: str,
    cache_dir: Path | None = None,
    extra_flags: tuple[str, ...] = (),
) -> ctypes.CDLL:
    """The built library, loaded (built first where it is missing or damaged). extra_flags: after the
    usual ones (the tests narrow the instruction set with them, e.g. `-mno-avx512f`). Raises OSError,
    RuntimeError or subprocess.SubprocessError when it cannot be built or loaded."""
    library = _library_path(name, sources + headers, compiler, cache_dir, extra_flags)
    if not library.exists():
        _compile(compiler, sources, library, extra_flags)
    try:
        return ctypes.CDLL(str(library))
    except OSError:  # a damaged cached build: rebuild it once
        library.unlink(missing_ok=True)
        _compile(compiler, sources, library, extra_flags)
        return ctypes.CDLL(str(library))


def _library_path(
    name: str, files: list[Path], compiler: str, cache_dir: Path | None, extra_flags: tuple[str, ...]
) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    flags = (*_flags(version), *extra_flags)
    digest = hashlib.sha256(" ".join(flags).encode() + version + _cpu_signature())
    for file in files:
        digest.update(file.read_bytes())
    folder = cache_dir or Path.home() / ".cache" / "coreserve" / "kernels"
    return folder / f"{name}-{digest.hexdigest()[:16]}.so"


def _compile(compiler: str, sources: list[Path], library: Path, extra_flags: tuple[str, ...]) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
        command = [compiler, *_flags(version), *extra_flags, *map(str, sources), "-o", tmp, "-lm"]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError as exc:
            logger.warning("building %s again with %s: %s", library.name, FALLBACK_DEFINE,
                           exc.stderr.decode(errors="replace")[-500:])
            subprocess.run([*command, FALLBACK_DEFINE], check=True, capture_output=True, timeout=120)
        os.chmod(tmp, 0o755)
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _flags(version: bytes) -> tuple[str, ...]:
    """The build's flags for the compiler whose `--version` this is (clang has no such --param)."""
    return FLAGS if b"clang" in version.lower() else FLAGS + GCC_FLAGS


def _cpu_signature() -> bytes:
    """The CPU's feature list (x86 `flags`, arm `Features`), or its machine name where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    features = [line for line in lines if line.startswith(("flags", "Features"))]
    return (features[0] if features else f"{platform.machine()} {platform.processor()}").encode()
