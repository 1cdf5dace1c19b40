"""The wheel's build: setuptools as pyproject.toml configures it, plus the C kernels prebuilt for each
x86-64 level into coreserve/worker/cpu/prebuilt/ and the manylinux tag they allow (docs/install.md,
"Kernels in the wheel"). On another CPU, or without a compiler, the wheel carries none and is pure:
the kernels build at first use from the sources it ships, as in a checkout.

CORESERVE_KERNEL_VARIANTS (read here only): the variants to build, comma-separated, or "none"; all by
default. `python setup.py build_kernels` builds them into the checkout itself.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from setuptools import Command, Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1 keeps it in the wheel package
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # this checkout's coreserve, whose prebuild imports only the standard library
from coreserve.worker.cpu import prebuild  # noqa: E402


def chosen_variants() -> list[str] | None:
    names = os.environ.get("CORESERVE_KERNEL_VARIANTS", "").strip()
    if not names:
        return None
    chosen = [] if names == "none" else [name.strip() for name in names.split(",")]
    unknown = sorted(set(chosen) - {variant.name for variant in prebuild.VARIANTS})
    if unknown:
        raise SystemExit(f"CORESERVE_KERNEL_VARIANTS names no variant {unknown}; known: "
                         f"{', '.join(variant.name for variant in prebuild.VARIANTS)} or none")
    return chosen


def build_kernels_into(root: Path) -> None:
    names = chosen_variants()
    if not prebuild.can_prebuild() or names == []:
        logging.info("no prebuilt kernels: they build at first use")
        return
    begun = time.perf_counter()
    built = prebuild.build_variants(root / prebuild.PACKAGE_FOLDER, names)
    logging.info("prebuilt kernels %s in %.1f s", ", ".join(built) or "none", time.perf_counter() - begun)


class BuildPyWithKernels(build_py):
    """build_py, then the kernel variants beside the package's files (not in an editable install, whose
    checkout builds at first use or by `build_kernels`)."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            build_kernels_into(Path(self.build_lib))


class BuildKernels(Command):
    description = "build the C kernel variants into this checkout's coreserve/worker/cpu/prebuilt/"
    user_options: list = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        build_kernels_into(ROOT)


class KernelDistribution(Distribution):
    """A platform distribution where the variants are built: its files go to platlib, not purelib (no
    Python extension: the libraries are loaded with ctypes)."""

    def has_ext_modules(self) -> bool:
        return prebuild.can_prebuild() and chosen_variants() != []


class BdistWheelTagged(bdist_wheel):
    """py3-none-manylinux_2_N_x86_64 where the variants were built (glibc alone), else py3-none-any."""

    def get_tag(self) -> tuple[str, str, str]:
        if self.root_is_pure:
            return super().get_tag()
        built = Path(self.get_finalized_command("build_py").build_lib) / prebuild.PACKAGE_FOLDER
        tag = prebuild.manylinux_tag(built) if built.is_dir() else None
        return ("py3", "none", tag or f"linux_{os.uname().machine}")  # linux_*: for auditwheel repair


logging.basicConfig(level=logging.INFO, format="%(message)s")
setup(
    distclass=KernelDistribution,
    cmdclass={"build_py": BuildPyWithKernels, "build_kernels": BuildKernels, "bdist_wheel": BdistWheelTagged},
)
