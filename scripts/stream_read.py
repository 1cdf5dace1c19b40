"""The two-stream memory read probe (scripts/csrc/stream_read.c), built with the worker's build
helper: a benchmark's measure of the read rate the few-row products can reach, not part of the engine."""

from __future__ import annotations

import ctypes
from pathlib import Path

from coreserve.worker.cpu.build import find_compiler, load_library

SOURCE = Path(__file__).resolve().parent / "csrc" / "stream_read.c"


def load_stream_sum():
    """stream_sum(address, num_floats, num_threads) -> float, or None without a C compiler."""
    compiler = find_compiler()
    if compiler is None:
        return None
    function = load_library("stream_read", [SOURCE], [], compiler).stream_sum
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
    function.restype = ctypes.c_float
    return function
