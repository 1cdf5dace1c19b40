"""The C kernels' prebuilt variants, one per x86-64 level that the sources tell apart, and the choice of
the library to load by `EngineConfig.kernel_variant` and what this CPU has (engine-core process at load;
setup.py at wheel-build time: this module imports only the standard library).

A variant is a level: the compiler flags it is built with, the CPU features (as /proc/cpuinfo names them)
a CPU needs to run it, and whether its bf16 products take AVX512-BF16's dot instruction. The levels are
where the sources' `#if`s differ (`__AVX2__`, `__AVX512F__`, `__AVX512VNNI__`, `__AVX512VBMI__`) and that
instruction (other sums than the widening product's), which every x86 build carries behind a target
attribute: a variant below avx512_bf16 never takes it, so a fleet pinned to one gets one bf16 product on
every host. The AMX tiles run where cpuid and the kernel (arch_prctl) allow, in every variant, only
without batch invariance (gemm_amx.c's `cpu_has_amx`). docs/install.md has the table.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path

from coreserve.worker.cpu.build import compile_flags

CSRC = Path(__file__).with_name("csrc")
PREBUILT = Path(__file__).with_name("prebuilt")  # <variant>/libcpu_kernels.so and MANIFEST, in a wheel
LIBRARY_NAME = "libcpu_kernels.so"
MANIFEST = "manifest.json"
SOURCES = [CSRC / name for name in (
    "decode_attention.c", "logprob_rows.c", "fused_ops.c", "gemv.c", "decode_forward.c", "gemm_amx.c",
    "gemv_quant.c", "gemv_int8.c", "int8_panels.c", "lora_rows.c", "recurrent_mixers.c",
)]
# Part of the build key and of the manifest's digest, included by the sources.
HEADERS = [CSRC / name for name in (
    "vector_exp.h", "gemv_bf16_dot.h", "kernel_parts.h", "decode_forward.h", "quant_blocks.h",
    "int8_blocks.h", "lora_rows.h",
)]


@dataclass(frozen=True)
class KernelVariant:
    name: str
    target: tuple[str, ...]  # the compiler's flags for the level
    cpu_features: frozenset[str]  # /proc/cpuinfo's names of what the level's instructions need
    has_bf16_dot: bool = False  # bf16 products on AVX512-BF16's dot instruction (else widened to fp32)


_V3 = ("cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2",  # x86-64-v2's, then v3's
       "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")

# Least to most; "auto" takes the last one this CPU runs.
VARIANTS = (
    KernelVariant("generic", ("-march=x86-64",), frozenset()),
    KernelVariant("avx2", ("-march=x86-64-v3",), frozenset(_V3)),  # Haswell, Zen 1-3
    KernelVariant("avx512", ("-march=x86-64-v4",), frozenset(_V4)),  # Skylake-SP
    # Cascade Lake, Cooper Lake, Ice Lake: integer mode's VNNI dot products
    KernelVariant("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"), frozenset((*_V4, "avx512_vnni"))),
    # Sapphire Rapids and later, Zen 4 and later: Q6_K's VBMI byte permutations and the bf16 dot besides
    KernelVariant("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512vbmi", "-mavx512bf16"),
                  frozenset((*_V4, "avx512_vnni", "avx512vbmi", "avx512_bf16")), has_bf16_dot=True),
)
SETTINGS = ("auto", "native", *(variant.name for variant in VARIANTS))  # EngineConfig.kernel_variant's values


def cpu_features() -> frozenset[str]:
    """This CPU's x86 features as the kernel reports them (/proc/cpuinfo's `flags`, which leaves out what
    the kernel will not run, e.g. AVX-512 it does not save); empty on other CPUs and systems."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    flags = next((line for line in lines if line.startswith("flags")), "")
    return frozenset(flags.partition(":")[2].split())


def runnable_variants(features: frozenset[str]) -> list[KernelVariant]:
    """The variants a CPU with these features runs, least to most (none off x86, whose features are empty)."""
    if not features:
        return []
    return [variant for variant in VARIANTS if variant.cpu_features <= features]


def choose_variant(setting: str, features: frozenset[str], prebuilt: frozenset[str]) -> KernelVariant | None:
    """The variant to load, None for the first-use -march=native build. "auto": the best prebuilt one
    this CPU runs, else native; a variant's name: that one (prebuilt, or built here at first use), a
    ValueError where this CPU cannot run it."""
    if setting == "native":
        return None
    runnable = runnable_variants(features)
    if setting == "auto":
        usable = [variant for variant in runnable if variant.name in prebuilt]
        return usable[-1] if usable else None
    named = {variant.name: variant for variant in VARIANTS}
    if setting not in named:
        raise ValueError(f"kernel_variant must be one of {', '.join(SETTINGS)}, got {setting!r}")
    variant = named[setting]
    if variant not in runnable:
        missing = sorted(variant.cpu_features - features) or [platform.machine() + " is not x86-64"]
        raise ValueError(
            f"kernel_variant={setting!r} needs CPU features this CPU lacks ({', '.join(missing)}); this CPU "
            f"runs {', '.join(v.name for v in runnable) or 'no prebuilt variant'}: pin one every host of the "
            "fleet runs, or use auto or native"
        )
    return variant


def sources_digest(files: list[Path]) -> str:
    """What a prebuilt library was built from: a digest of the sources' and headers' names and bytes."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def prebuilt_variants(folder: Path) -> frozenset[str]:
    """The variants in folder built from these sources with today's whole flags, gcc's or clang's (a
    checkout whose csrc/, variant table or build flags changed since has none: they would be other code)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return frozenset()
    if manifest.get("sources") != sources_digest(SOURCES + HEADERS):
        return frozenset()
    built = manifest.get("variants", {})
    return frozenset(
        variant.name for variant in VARIANTS
        if built.get(variant.name) in [list(compile_flags(kind, variant.target)) for kind in (b"gcc", b"clang")]
        and (folder / variant.name / LIBRARY_NAME).is_file()
    )
