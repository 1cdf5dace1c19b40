"""Builds and loads the C kernels for the CPU: decode attention and top-k logprob rows (engine-core
process).

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

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("decode_attention.c", "logprob_rows.c")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    # q, out, key_cache, value_cache, num_slots, rows, block_tables, max_blocks, context_lens,
    # num_rows, num_q_heads, num_kv_heads, head_dim, block_size, scale, num_threads
    "decode_attention": [_P, _P, _P, _P, _I64, _P, _P, _I32, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32],
    # scores, num_rows, vocab, row_stride, k, values, ids, lse, num_threads
    "logprob_rows": [_P, _I64, _I64, _I64, _I32, _P, _P, _P, _I32],
}


@dataclass(frozen=True)
class CpuKernels:
    decode_attention: ctypes._CFuncPtr
    logprob_rows: ctypes._CFuncPtr


def load_cpu_kernels(cache_dir: Path | None = None) -> CpuKernels | None:
    """The kernels, or None (with a warning) when they cannot be built here."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: attention and logprobs run on the slower torch paths")
        return None
    digest = hashlib.sha256(" ".join(_FLAGS).encode() + _cpu_signature())
    for source in _SOURCES:
        digest.update(source.read_bytes())
    folder = cache_dir or Path.home() / ".cache" / "coreserve" / "kernels"
    library = folder / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    try:
        if not library.exists():
            _compile(compiler, library)
        loaded = ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        logger.warning("CPU kernels unavailable (%s): using the torch paths", exc)
        return None
    functions = {}
    for name, argtypes in _SIGNATURES.items():
        function = getattr(loaded, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int if name == "decode_attention" else None
        functions[name] = function
    return CpuKernels(**functions)


def _compile(compiler: str, library: Path) -> None:
    """Compiles to a temporary name and renames, so processes building at once never load half a file."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_signature() -> bytes:
    """-march=native code is only valid on the CPU it was built for: key the build by its flags."""
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return (flags[0] if flags else platform.processor()).encode()
    except OSError:
        return platform.machine().encode()


def decode_attention(
    kernels: CpuKernels,
    q: torch.Tensor,
    out: torch.Tensor,
    cache: torch.Tensor,
    rows,
    block_tables,
    context_lens,
    block_size: int,
    scale: float,
) -> None:
    """q, out: [T, Hq, D] float32 contiguous; cache: [2, Hkv, slots, D]; rows [R] int64, block_tables
    [R, max_blocks] int32, context_lens [R] int32 numpy arrays (C-contiguous)."""
    assert q.is_contiguous() and out.is_contiguous() and cache.is_contiguous() and q.dtype == torch.float32
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    status = kernels.decode_attention(
        q.data_ptr(),
        out.data_ptr(),
        cache[0].data_ptr(),
        cache[1].data_ptr(),
        cache.shape[2],
        rows.ctypes.data,
        block_tables.ctypes.data,
        block_tables.shape[1],
        context_lens.ctypes.data,
        len(rows),
        num_q_heads,
        cache.shape[1],
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("decode attention could not allocate its scratch memory")


def logprob_rows(kernels: CpuKernels, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: [R, V] float32 with unit column stride. Returns the k largest as logprobs [R, k] float32
    (largest first, lower token id first among equals) with their ids [R, k] int64, and the rows'
    log-sum-exp [R, 1] float32."""
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
