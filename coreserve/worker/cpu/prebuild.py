"""The wheel's prebuilt C kernels: every variant of kernel_variants.py compiled into a folder with a
manifest, and the manylinux tag the result allows (setup.py at wheel-build time, and `python setup.py
build_kernels` in a checkout; imports only the standard library, for a build environment has no torch).

The libraries are linked without libgomp: their OpenMP calls bind at load to the runtime torch has put
in the process's global scope, so the wheel bundles no second runtime and needs only glibc.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coreserve.worker.cpu.build import compile_flags, compile_library, compiler_version, find_compiler
from coreserve.worker.cpu.kernel_variants import (
    HEADERS,
    LIBRARY_NAME,
    MANIFEST,
    SOURCES,
    VARIANTS,
    KernelVariant,
    sources_digest,
)

logger = logging.getLogger(__name__)

PACKAGE_FOLDER = Path("coreserve", "worker", "cpu", "prebuilt")  # under a build's or the checkout's root
# The libraries a manylinux wheel may need from the system: glibc's own (PEP 600)
GLIBC_LIBRARIES = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "ld-linux-x86-64.so.2"}
# The glibc minors of the manylinux policies (auditwheel's, each with a build image): a tag names the first
# of them that has every symbol version used, as `auditwheel show` does; 17 is manylinux2014's.
MANYLINUX_GLIBC = (17, 24, 26, 27, 28, 31, 34, 35, 36, 37, 38, 39, 40, 41)


def can_prebuild() -> bool:
    """Whether this build host makes the variants: an x86-64 machine with a C compiler."""
    return platform.machine().lower() in ("x86_64", "amd64") and find_compiler() is not None


def build_variants(folder: Path, names: list[str] | None = None, jobs: int | None = None) -> list[str]:
    """Builds the variants (names: some of them; all by default) into folder/<name>/libcpu_kernels.so,
    several at once, and writes the manifest of those built. Returns their names; a variant the
    compiler cannot build is left out with a warning (the loader then builds at first use)."""
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler: the wheel carries no prebuilt kernels (they build at first use)")
        return []
    chosen = [variant for variant in VARIANTS if names is None or variant.name in names]
    version = compiler_version(compiler)
    shutil.rmtree(folder, ignore_errors=True)  # nothing of an earlier or cut-short build goes in a wheel
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda variant: _build_one(compiler, version, variant, folder), chosen))
    built = [variant for variant, is_built in zip(chosen, results) if is_built]
    manifest = {
        "sources": sources_digest(SOURCES + HEADERS),
        "compiler": version.decode(errors="replace").splitlines()[0] if version else compiler,
        "variants": {variant.name: list(compile_flags(version, variant.target)) for variant in built},  # whole flags
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return [variant.name for variant in built]


def _build_one(compiler: str, version: bytes, variant: KernelVariant, folder: Path) -> bool:
    library = folder / variant.name / LIBRARY_NAME
    try:
        compile_library(compiler, SOURCES, library, compile_flags(version, variant.target), link_openmp=False)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("prebuilt kernels: %s left out (%s)", variant.name, exc)
        return False
    return True


def manylinux_tag(folder: Path) -> str | None:
    """The wheel's platform tag for the libraries under folder: manylinux_2_<N>_x86_64, the first policy
    with the newest glibc symbol version they use, where they need no library but glibc's; None where
    there is none or something else is needed (then `auditwheel repair` has to bundle it)."""
    libraries = sorted(folder.rglob("*.so"))
    if not libraries:
        return None
    newest = 0
    for library in libraries:
        try:
            headers = subprocess.run(["objdump", "-p", str(library)], capture_output=True, text=True,
                                     check=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("cannot read %s's needs (%s): no manylinux tag", library, exc)
            return None
        needed = set(re.findall(r"^\s*NEEDED\s+(\S+)", headers, re.MULTILINE))
        if not needed <= GLIBC_LIBRARIES:
            logger.warning("%s needs %s beyond glibc: no manylinux tag", library, sorted(needed - GLIBC_LIBRARIES))
            return None
        versions = [int(minor) for minor in re.findall(r"\bGLIBC_2\.(\d+)", headers)]
        newest = max([newest, *versions])
    policy = next((minor for minor in MANYLINUX_GLIBC if minor >= newest), None)
    return f"manylinux_2_{policy}_x86_64" if policy is not None else None
