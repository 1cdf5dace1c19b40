"""Builds and loads the C decode-attention kernel for the CPU (engine-core process).

The kernel is compiled once per source, compiler and CPU into `~/.cache/coreserve/kernels/` and loaded
with ctypes after torch, so its OpenMP pragmas run on the runtime torch already loaded. Without a C
compiler the worker keeps the torch attention path: slower, the same numbers to float rounding.
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

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_ARGTYPES = [
    ctypes.c_void_p,  # q
    ctypes.c_void_p,  # out
    ctypes.c_void_p,  # key_cache
    ctypes.c_void_p,  # value_cache
    ctypes.c_int64,  # num_slots
    ctypes.c_void_p,  # rows
    ctypes.c_void_p,  # block_tables
    ctypes.c_int32,  # max_blocks
    ctypes.c_void_p,  # context_lens
    ctypes.c_int32,  # num_rows
    ctypes.c_int32,  # num_q_heads
    ctypes.c_int32,  # num_kv_heads
    ctypes.c_int32,  # head_dim
    ctypes.c_int32,  # block_size
    ctypes.c_float,  # scale
    ctypes.c_int32,  # num_threads
]


def load_decode_attention(cache_dir: Path | None = None):
    """The kernel's C function, or None (with a warning) when it cannot be built here."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: decode attention runs on the slower torch path")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_signature()).hexdigest()[:16]
    library = (cache_dir or Path.home() / ".cache" / "coreserve" / "kernels") / f"decode_attention-{key}.so"
    try:
        if not library.exists():
            _compile(compiler, library)
        function = ctypes.CDLL(str(library)).decode_attention
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("decode attention kernel unavailable (%s): using the torch path", exc)
        return None
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function


def _compile(compiler: str, library: Path) -> None:
    """Compiles to a temporary name and renames, so processes building at once never load half a file."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120
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
    function,
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
    status = function(
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
