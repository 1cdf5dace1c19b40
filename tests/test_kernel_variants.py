"""The wheel's prebuilt kernel variants (coreserve/worker/cpu/kernel_variants.py, prebuild.py): each one
this CPU runs, loaded by its name, gives the bits of a -march=<level> build of the same sources by the
same compiler through the first-use path; "auto" takes the best level this CPU's cpuid reports; a variant
the CPU cannot run, or no variant at all, is refused by name; the libraries need nothing beyond glibc and
run on torch's OpenMP runtime."""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import numpy as np
import pytest
import torch

from coreserve.engine_core.core import runner_spec
from coreserve.frontend.server.args import add_serve_arguments, engine_kwargs
from coreserve.protocol.config import EngineConfig, KernelVariantSetting
from coreserve.worker.cpu import prebuild
from coreserve.worker.cpu.bindings import SIGNATURES
from coreserve.worker.cpu.build import compiler_version, find_compiler, load_library
from coreserve.worker.cpu.kernel_variants import (
    CSRC,
    HEADERS,
    LIBRARY_NAME,
    MANIFEST,
    PREBUILT,
    SETTINGS,
    SOURCES,
    VARIANTS,
    choose_variant,
    cpu_features,
    prebuilt_variants,
    runnable_variants,
)
from coreserve.worker.cpu.kernels import decode_attention, load_cpu_kernels, logprob_rows

COMPILER = find_compiler()
RUNNABLE = [variant.name for variant in runnable_variants(cpu_features())]
NAMED = {variant.name: variant for variant in VARIANTS}
needs_variants = pytest.mark.skipif(COMPILER is None or not RUNNABLE, reason="x86-64 variants need a C compiler")
PROBED = ("gemv.c", "decode_attention.c", "logprob_rows.c")  # the kernels compared bit for bit
AVX2_ONLY = frozenset(NAMED["avx2"].cpu_features)  # a Haswell's or a Zen 2's features


@pytest.fixture(scope="module")
def prebuilt_dir() -> Path:
    """The variants to test: CORESERVE_TEST_PREBUILT_DIR where set (scripts/wheel_smoke.sh points it at the
    built wheel's own libraries, every level this CPU runs); else the package's where they are current
    (`python setup.py build_kernels`); else the lowest and the widest level this CPU runs, built as the wheel
    builds them into a folder kept per sources and compiler (a first run compiles them; later ones find
    them). The suite compares those two; the wheel smoke compares them all."""
    if os.environ.get("CORESERVE_TEST_PREBUILT_DIR"):
        folder = Path(os.environ["CORESERVE_TEST_PREBUILT_DIR"])
        assert set(RUNNABLE) <= prebuilt_variants(folder), f"{folder} lacks some of {RUNNABLE}"
        return folder
    if set(RUNNABLE) <= prebuilt_variants(PREBUILT):
        return PREBUILT
    key = hashlib.sha256(compiler_version(COMPILER))
    for path in SOURCES + HEADERS:
        key.update(path.read_bytes())
    folder = Path.home() / ".cache" / "coreserve" / "kernels" / f"prebuilt-{key.hexdigest()[:16]}"
    wanted = sorted({RUNNABLE[0], RUNNABLE[-1]}, key=RUNNABLE.index)
    if not set(wanted) <= prebuilt_variants(folder):
        assert prebuild.build_variants(folder, wanted) == wanted
    return folder


def built(prebuilt_dir: Path) -> list[str]:
    """The levels this CPU runs that `prebuilt_dir` holds, lowest first."""
    return [name for name in RUNNABLE if name in prebuilt_variants(prebuilt_dir)]


def probe_library(library: ctypes.CDLL) -> SimpleNamespace:
    """The three probed functions of a library with their signatures (a part-built library has no others)."""
    functions = {}
    for name in ("gemv_f32", "decode_attention", "logprob_rows"):
        function = getattr(library, name)
        function.argtypes = [kind for _, kind in SIGNATURES[name].args]
        function.restype = SIGNATURES[name].restype
        functions[name] = function
    return SimpleNamespace(**functions)


def probe_outputs(kernels) -> list[torch.Tensor]:
    """A product, decode attention and logprob rows on fixed random inputs."""
    generator = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(*shape, generator=generator) for shape in ((3, 1000), (300, 1000), (300,)))
    product = torch.empty(3, 300)
    kernels.gemv_f32(x.data_ptr(), 3, 1000, w.data_ptr(), 300, bias.data_ptr(), product.data_ptr(),
                     torch.get_num_threads())
    q, cache = torch.randn(3, 4, 64, generator=generator), torch.randn(2, 2, 8 * 16, 64, generator=generator)
    attention = torch.empty_like(q)
    block_tables = np.arange(9, dtype=np.int32).reshape(3, 3) % 8
    rows, context_lens = np.arange(3, dtype=np.int64), np.array([40, 1, 33], dtype=np.int32)
    decode_attention(kernels, q, attention, cache, rows, block_tables, context_lens, 16, 0.125)
    values, ids, lse = logprob_rows(kernels, torch.randn(3, 5000, generator=generator), 5)
    return [product, attention, values, ids, lse]


def loaded_variant(caplog, setting: str, prebuilt_dir: Path):
    with caplog.at_level("INFO", logger="coreserve.worker.cpu.kernels"):
        kernels = load_cpu_kernels(setting=setting, prebuilt_dir=prebuilt_dir)
    return kernels, caplog.records[-1].getMessage()


@needs_variants
@pytest.mark.parametrize("name", [variant.name for variant in VARIANTS])
def test_each_variant_gives_the_bits_of_its_level_built_at_first_use(name, prebuilt_dir, tmp_path, caplog):
    if name not in RUNNABLE:
        pytest.skip(f"this CPU does not run {name}")
    if name not in built(prebuilt_dir):
        pytest.skip(f"{name} is not built here (scripts/wheel_smoke.sh compares every level on the wheel's own)")
    kernels, how = loaded_variant(caplog, name, prebuilt_dir)
    assert f"prebuilt variant {name}" in how
    reference = load_library("probe", [CSRC / file for file in PROBED], HEADERS, COMPILER, tmp_path,
                             target=NAMED[name].target)
    for ours, theirs in zip(probe_outputs(kernels), probe_outputs(probe_library(reference)), strict=True):
        assert torch.equal(ours, theirs)


@needs_variants
def test_the_comparison_tells_the_levels_apart(prebuilt_dir):
    """The check above can fail: the widest level this CPU runs sums a product in another order than
    the generic one, so a wrong variant loaded under a name would show."""
    if RUNNABLE[-1] == "generic":
        pytest.skip("this CPU runs the generic level only")
    generic = probe_outputs(load_cpu_kernels(setting="generic", prebuilt_dir=prebuilt_dir))
    widest = probe_outputs(load_cpu_kernels(setting=RUNNABLE[-1], prebuilt_dir=prebuilt_dir))
    assert not torch.equal(generic[0], widest[0])


@needs_variants
def test_auto_takes_the_best_level_this_cpus_cpuid_reports(prebuilt_dir, tmp_path, caplog):
    """The levels from cpuid as the compiler's own runtime reads it, not from /proc/cpuinfo's names."""
    probe = tmp_path / "levels.c"
    levels = ("x86-64-v3", "x86-64-v4", "avx512vnni", "avx512vbmi", "avx512bf16")
    probe.write_text("#include <stdio.h>\nint main(void) { __builtin_cpu_init(); "
                     + " ".join(f'printf("%d ", !!__builtin_cpu_supports("{level}"));' for level in levels) + " }\n")
    subprocess.run([COMPILER, str(probe), "-o", str(tmp_path / "levels")], check=True, timeout=60)
    v3, v4, vnni, vbmi, bf16 = map(int, subprocess.run([tmp_path / "levels"], capture_output=True, check=True,
                                                       text=True).stdout.split())
    expected = ("avx512_bf16" if v4 and vnni and vbmi and bf16 else "avx512_vnni" if v4 and vnni else
                "avx512" if v4 else "avx2" if v3 else "generic")
    _, how = loaded_variant(caplog, "auto", prebuilt_dir)
    assert how == f"CPU kernels: prebuilt variant {expected} (kernel_variant=auto)"


def test_a_variant_the_cpu_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match=r"avx512_bf16.*avx512_bf16, avx512_vnni, avx512bw.*runs generic, avx2"):
        choose_variant("avx512_bf16", AVX2_ONLY, frozenset(NAMED))
    assert choose_variant("auto", AVX2_ONLY, frozenset(NAMED)) == NAMED["avx2"]
    assert choose_variant("auto", AVX2_ONLY, frozenset({"generic"})) == NAMED["generic"]
    assert choose_variant("auto", frozenset(), frozenset(NAMED)) is None  # arm64: the native build
    with pytest.raises(ValueError, match="not x86-64"):
        choose_variant("generic", frozenset(), frozenset(NAMED))
    for name in set(NAMED) - set(RUNNABLE):  # and for real, where this CPU lacks a level
        with pytest.raises(ValueError, match=f"kernel_variant='{name}' needs CPU features"):
            load_cpu_kernels(setting=name)


def test_kernel_variant_is_an_engine_argument_with_the_loaders_values():
    assert get_args(KernelVariantSetting) == SETTINGS
    with pytest.raises(ValueError, match="kernel_variant must be one of auto, native, generic"):
        EngineConfig(model="m", kernel_variant="avx3")
    assert runner_spec(EngineConfig(model="m", kernel_variant="avx2")).kernel_variant == "avx2"
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert engine_kwargs(parser.parse_args(["--kernel-variant", "avx512"])) == {"kernel_variant": "avx512"}


@needs_variants
def test_the_variants_load_where_no_compiler_is(prebuilt_dir, tmp_path, monkeypatch, caplog):
    """The wheel's point: no cc on PATH, and the kernels are there; a pinned variant the install lacks is
    then refused, and "native" falls back to torch's paths with a warning, as before."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_compiler() is None
    _, how = loaded_variant(caplog, RUNNABLE[0], prebuilt_dir)
    assert how == f"CPU kernels: prebuilt variant {RUNNABLE[0]} (kernel_variant={RUNNABLE[0]})"
    with pytest.raises(ValueError, match=f"kernel_variant='{RUNNABLE[0]}' cannot be had here: no C compiler"):
        load_cpu_kernels(setting=RUNNABLE[0], prebuilt_dir=tmp_path)
    assert load_cpu_kernels(setting="auto", prebuilt_dir=tmp_path) is None
    assert "no C compiler found; attention and logprobs run on the slower torch paths" in caplog.text


@needs_variants
def test_only_the_bf16_level_takes_the_bf16_dot_instruction(prebuilt_dir):
    """Its sums differ from the widening product's: below avx512_bf16 a variant never takes it, so a fleet
    pinned to one level gets one bf16 product whichever of its CPUs has the instruction."""
    for name in built(prebuilt_dir):
        kernels = load_cpu_kernels(setting=name, prebuilt_dir=prebuilt_dir)
        assert kernels.has_bf16_dot == (name == "avx512_bf16"), name
        assert bool(kernels.cpu_has_bf16_dot()) == ("avx512_bf16" in cpu_features())  # the CPU's own answer


@needs_variants
def test_a_prebuilt_variant_is_taken_only_from_its_own_sources(prebuilt_dir, tmp_path):
    """A checkout whose csrc/ changed after `build_kernels` must not load the older code."""
    shutil.copytree(prebuilt_dir / "generic", tmp_path / "generic")
    manifest = json.loads((prebuilt_dir / MANIFEST).read_text())
    generic = manifest["variants"]["generic"]
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "variants": {"generic": generic}}))
    assert prebuilt_variants(tmp_path) == {"generic"}
    older_flags = [flag.replace("-O3", "-O2") for flag in generic]  # a build.py since changed
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "variants": {"generic": older_flags}}))
    assert prebuilt_variants(tmp_path) == frozenset()
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "sources": "0" * 64}))
    assert prebuilt_variants(tmp_path) == frozenset()


@needs_variants
def test_the_libraries_need_only_glibc_and_run_on_torchs_openmp(prebuilt_dir):
    for name in built(prebuilt_dir):
        needed = subprocess.run(["readelf", "-d", str(prebuilt_dir / name / LIBRARY_NAME)], capture_output=True,
                                text=True, check=True).stdout
        assert "libgomp" not in needed and "NEEDED" in needed
    assert prebuild.manylinux_tag(prebuilt_dir).startswith("manylinux_2_")
    before = _openmp_runtimes()  # another package's may be loaded already (sentencepiece's wheel bundles one)
    load_cpu_kernels(setting=RUNNABLE[-1], prebuilt_dir=prebuilt_dir)
    after = _openmp_runtimes()
    assert after == before and any("torch" in path for path in after)  # torch's runtime, none added by ours


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process, by path."""
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
