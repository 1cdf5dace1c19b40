"""Builds and loads the C kernels for the CPU: decode attention, top-k logprob rows, the fused
layer steps (RoPE with the KV write, SiLU-and-multiply), the few-row matrix products of fp32 and
bf16 weights and the whole model forward of a few-row decode step (engine-core process).

The kernels are compiled once per source, compiler and CPU into `~/.cache/coreserve/kernels/` and
loaded with ctypes after torch, so their OpenMP pragmas run on the runtime torch already loaded.
Without a C compiler the worker keeps the torch paths: slower, the same numbers to float rounding.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name("csrc") / n
    for n in (
        "decode_attention.c",
        "logprob_rows.c",
        "fused_ops.c",
        "gemv.c",
        "decode_forward.c",
        "gemm_amx.c",
    )
]
# Part of the build key, included by the sources.
_HEADERS = [Path(__file__).with_name("csrc") / n for n in ("vector_exp.h", "gemv_bf16_dot.h", "kernel_parts.h")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    # q, out, key_cache, value_cache, num_slots, rows, block_tables, max_blocks, context_lens,
    # num_rows, num_q_heads, num_kv_heads, head_dim, block_size, scale, window, num_threads
    "decode_attention": [
        _P,
        _P,
        _P,
        _P,
        _I64,
        _P,
        _P,
        _I32,
        _P,
        _I32,
        _I32,
        _I32,
        _I32,
        _I32,
        _F32,
        _I32,
        _I32,
    ],
    # scores, num_rows, vocab, row_stride, k, values, ids, lse, num_threads
    "logprob_rows": [_P, _I64, _I64, _I64, _I32, _P, _P, _P, _I32],
    # scores, num_rows, vocab, row_stride, ids, num_threads
    "argmax_rows": [_P, _I64, _I64, _I64, _P, _I32],
    # qkv, cos, signed_sin, slots, num_tokens, num_q_heads, num_kv_heads, head_dim, q_out, k_out,
    # key_cache, value_cache, num_slots, num_threads
    "rope_write_kv": [_P, _P, _P, _P, _I64, _I32, _I32, _I32, _P, _P, _P, _P, _I64, _I32],
    # gate_up, num_tokens, intermediate, out, num_threads
    "silu_mul": [_P, _I64, _I64, _P, _I32],
    # x, delta, num_tokens, hidden, weight, eps, sum_out, out, num_threads
    "rms_norm": [_P, _P, _I64, _I64, _P, _F32, _P, _P, _I32],
    # x, rows, K, w, N, bias, out, num_threads
    "gemv_f32": [_P, _I64, _I64, _P, _I64, _P, _P, _I32],
    # x, rows, K, w, N, bias, out, use_dot, num_threads
    "gemv_bf16": [_P, _I64, _I64, _P, _I64, _P, _P, _I32, _I32],
    "cpu_has_bf16_dot": [],
    # x, rows, K, w, N, bias, out, num_threads
    "gemm_bf16_amx": [_P, _I64, _I64, _P, _I64, _P, _P, _I32],
    "cpu_has_amx": [],
    # a, n, num_threads: a read of memory as the few-row products read (scripts/bench_decode_step.py)
    "stream_sum": [_P, _I64, _I32],
    # model params, step params, out, eps, scale (worker/cpu/fused_decode.py)
    "decode_forward": [_P, _P, _P, _F32, _F32],
}
# What the functions return; the others return nothing.
_RESTYPES = {
    **dict.fromkeys(
        (
            "decode_attention",
            "gemv_bf16",
            "cpu_has_bf16_dot",
            "decode_forward",
            "gemm_bf16_amx",
            "cpu_has_amx",
        ),
        ctypes.c_int,
    ),
    "stream_sum": ctypes.c_float,
}


@dataclass(frozen=True)
class CpuKernels:
    decode_attention: ctypes._CFuncPtr
    logprob_rows: ctypes._CFuncPtr
    argmax_rows: ctypes._CFuncPtr
    rope_write_kv: ctypes._CFuncPtr
    silu_mul: ctypes._CFuncPtr
    rms_norm: ctypes._CFuncPtr
    gemv_f32: ctypes._CFuncPtr
    gemv_bf16: ctypes._CFuncPtr
    cpu_has_bf16_dot: ctypes._CFuncPtr
    gemm_bf16_amx: ctypes._CFuncPtr
    cpu_has_amx: ctypes._CFuncPtr
    decode_forward: ctypes._CFuncPtr
    stream_sum: ctypes._CFuncPtr
    has_bf16_dot: bool = False  # this CPU runs AVX512-BF16's dot instruction (asked at load)
    has_amx: bool = False  # this CPU runs AMX-BF16 and the kernel grants the tiles (asked at load)


def load_cpu_kernels(cache_dir: Path | None = None) -> CpuKernels | None:
    """The kernels, or None (with a warning) when they cannot be built here."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: attention and logprobs run on the slower torch paths")
        return None
    try:
        library = _library_path(compiler, cache_dir)
        if not library.exists():
            _compile(compiler, library)
        try:
            loaded = ctypes.CDLL(str(library))
        except OSError:  # a damaged cached build: rebuild it once
            library.unlink(missing_ok=True)
            _compile(compiler, library)
            loaded = ctypes.CDLL(str(library))
        functions = {name: getattr(loaded, name) for name in _SIGNATURES}
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable (%s): using the torch paths", exc)
        return None
    for name, function in functions.items():
        function.argtypes = _SIGNATURES[name]
        function.restype = _RESTYPES.get(name)
    return CpuKernels(
        **functions,
        has_bf16_dot=bool(functions["cpu_has_bf16_dot"]()),
        has_amx=bool(functions["cpu_has_amx"]()),
    )


def _library_path(compiler: str, cache_dir: Path | None) -> Path:
    """Keyed by the sources, the flags, the compiler's version and the CPU's features (the build
    uses -march=native, so a home shared between machines must not share builds)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    digest = hashlib.sha256(" ".join(_FLAGS).encode() + version + _cpu_signature())
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    folder = cache_dir or Path.home() / ".cache" / "coreserve" / "kernels"
    return folder / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def _compile(compiler: str, library: Path) -> None:
    """Compiles to a temporary name and renames, so processes building at once never load half a file."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        command = [compiler, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError as exc:  # an assembler too old for AMX: the rest without it
            logger.warning(
                "building the CPU kernels without AMX: %s", exc.stderr.decode(errors="replace")[-500:]
            )
            subprocess.run([*command, "-DCORESERVE_NO_AMX"], check=True, capture_output=True, timeout=120)
        os.chmod(tmp, 0o755)
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_signature() -> bytes:
    """The CPU's feature list (x86 `flags`, arm `Features`), or its machine name where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    features = [line for line in lines if line.startswith(("flags", "Features"))]
    return (features[0] if features else f"{platform.machine()} {platform.processor()}").encode()


def decode_attention(
    kernels: CpuKernels,
    q: torch.Tensor,
    out: torch.Tensor,
    cache: torch.Tensor,
    rows: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    block_size: int,
    scale: float,
    window: int = 0,
    pointers: tuple[int, int, int] | None = None,
) -> None:
    """q, out: [T, Hq, D] float32 contiguous; cache: [2, Hkv, slots, D]; rows [R] int64, block_tables
    [R, max_blocks] int32, context_lens [R] int32 numpy arrays (C-contiguous); window: a sliding
    window (each row attends to its last `window` positions), 0 for none; pointers: the three
    arrays' addresses where the caller has them already."""
    assert q.is_contiguous() and out.is_contiguous() and cache.is_contiguous() and q.dtype == torch.float32
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if pointers is None:
        pointers = (rows.ctypes.data, block_tables.ctypes.data, context_lens.ctypes.data)
    key_cache = cache.data_ptr()  # cache[0] and cache[1] would be two tensor views a call
    status = kernels.decode_attention(
        q.data_ptr(),
        out.data_ptr(),
        key_cache,
        key_cache + cache.stride(0) * cache.element_size(),
        cache.shape[2],
        pointers[0],
        pointers[1],
        block_tables.shape[1],
        pointers[2],
        len(rows),
        num_q_heads,
        cache.shape[1],
        head_dim,
        block_size,
        scale,
        window,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("decode attention could not allocate its scratch memory")


def logprob_rows(kernels: CpuKernels, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """scores: [R, V] float32 with unit column stride. Returns the k largest scores [R, k] float32
    (largest first, lower token id first among equals), their ids [R, k] int64, and the rows'
    log-sum-exp [R, 1] float32 (logprob = score - lse)."""
    assert scores.dtype == torch.float32 and scores.stride(1) == 1 and k >= 1
    num_rows, vocab = scores.shape
    values = torch.empty(num_rows, k, dtype=torch.float32)
    ids = torch.empty(num_rows, k, dtype=torch.int64)
    lse = torch.empty(num_rows, 1, dtype=torch.float32)
    kernels.logprob_rows(
        scores.data_ptr(), num_rows, vocab, scores.stride(0), k,
        values.data_ptr(), ids.data_ptr(), lse.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return values, ids, lse


def argmax_rows(kernels: CpuKernels, scores: torch.Tensor) -> torch.Tensor:
    """scores: [R, V] float32 with unit column stride -> [R] int64, as torch.argmax(dim=-1): the lowest
    id among equal scores, a NaN taken as the largest (one C pass; torch's took ~170 us a row)."""
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    ids = torch.empty(scores.shape[0], dtype=torch.int64)
    kernels.argmax_rows(
        scores.data_ptr(),
        scores.shape[0],
        scores.shape[1],
        scores.stride(0),
        ids.data_ptr(),
        torch.get_num_threads(),
    )
    return ids


def rope_write_kv(
    kernels: CpuKernels,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    slots: torch.Tensor,
    num_q_heads: int,
    cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (Hq + 2 Hkv) D] float32; cos, signed_sin: [T, 1, D]; slots: [T] int64; cache:
    [2, Hkv, slots, D]. Rotates q and k, writes k and v to the cache; returns q [T, Hq, D],
    k [T, Hkv, D] and v [T, Hkv, D] (a view of qkv)."""
    num_tokens, (num_kv_heads, num_slots, head_dim) = qkv.shape[0], cache.shape[1:]
    assert (
        qkv.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous() and cache.is_contiguous()
    )
    q = torch.empty(num_tokens, num_q_heads, head_dim)
    k = torch.empty(num_tokens, num_kv_heads, head_dim)
    kernels.rope_write_kv(
        qkv.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(), num_tokens,
        num_q_heads, num_kv_heads, head_dim, q.data_ptr(), k.data_ptr(), cache[0].data_ptr(),
        cache[1].data_ptr(), num_slots, torch.get_num_threads(),
    )  # fmt: skip
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v


def silu_mul(kernels: CpuKernels, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 I] float32 contiguous -> silu(gate) * up [T, I]."""
    assert gate_up.is_contiguous() and gate_up.dtype == torch.float32
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, intermediate)
    kernels.silu_mul(gate_up.data_ptr(), num_tokens, intermediate, out.data_ptr(), torch.get_num_threads())
    return out


def rms_norm(
    kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [T, hidden] float32 contiguous; weight: [hidden] float32. Returns (x + delta, or x
    itself without delta; its RMSNorm), the norm as HF's in fp32, to float rounding."""
    assert x.is_contiguous() and x.dtype == torch.float32 and weight.dtype == torch.float32
    out = torch.empty_like(x)
    total = x if delta is None else torch.empty_like(x)
    kernels.rms_norm(
        x.data_ptr(), None if delta is None else delta.contiguous().data_ptr(), x.shape[0], x.shape[1],
        weight.data_ptr(), eps, total.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return total, out
