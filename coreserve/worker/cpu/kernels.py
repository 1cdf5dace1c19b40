"""The C kernels for the CPU, loaded, and their Python faces: decode attention, top-k logprob rows,
the fused layer steps (RMSNorm with the residual add, RoPE with the KV write, SiLU-and-multiply)
(engine-core process). The products are in coreserve/worker/cpu/linear.py, the fused forward in
coreserve/worker/cpu/fused_decode.py; the sources in csrc/, the signatures in bindings.py.

The library is loaded with ctypes after torch, so its OpenMP pragmas run on the runtime torch already
loaded. Without a C compiler the worker keeps the torch paths: slower, the same numbers to float
rounding.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import numpy as np
import torch

from coreserve.worker.cpu.bindings import CpuKernels, bind
from coreserve.worker.cpu.build import find_compiler, load_library

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in (
    "decode_attention.c", "logprob_rows.c", "fused_ops.c", "gemv.c", "decode_forward.c", "gemm_amx.c",
    "gemv_quant.c", "gemv_int8.c", "int8_panels.c", "lora_rows.c",
)]
# Part of the build key, included by the sources.
_HEADERS = [_CSRC / name for name in (
    "vector_exp.h", "gemv_bf16_dot.h", "kernel_parts.h", "decode_forward.h", "quant_blocks.h",
    "int8_blocks.h", "lora_rows.h",
)]


def load_cpu_kernels(cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> CpuKernels | None:
    """The kernels, or None (with a warning) when they cannot be built here. extra_flags: see
    build.load_library."""
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: attention and logprobs run on the slower torch paths")
        return None
    try:
        return bind(load_library("cpu_kernels", _SOURCES, _HEADERS, compiler, cache_dir, extra_flags))
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable (%s): using the torch paths", exc)
        return None


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
    softcap: float = 0.0,
) -> None:
    """q, out: [T, Hq, D] float32 contiguous; cache: [2, Hkv, slots, D]; rows [R] int64, block_tables
    [R, max_blocks] int32, context_lens [R] int32 numpy arrays (C-contiguous); window: a sliding
    window (each row attends to its last `window` positions), 0 for none; pointers: the three
    arrays' addresses where the caller has them already; softcap: Gemma 2's cap on the scores, 0 none."""
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
        softcap,
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
    )
    return values, ids, lse


def argmax_rows(kernels: CpuKernels, scores: torch.Tensor) -> torch.Tensor:
    """scores: [R, V] float32 with unit column stride -> [R] int64, as torch.argmax(dim=-1): the lowest
    id among equal scores, a NaN taken as the largest (one C pass: torch's is slow on a swept cache)."""
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
    )
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
    )
    return total, out
