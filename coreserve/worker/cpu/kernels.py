"""The C kernels for the CPU, loaded, and their Python faces: decode attention, top-k logprob rows,
the fused layer steps (RMSNorm with the residual add, RoPE with the KV write, SiLU-and-multiply)
(engine-core process). The products are in coreserve/worker/cpu/linear.py, the fused forward in
coreserve/worker/cpu/fused_decode.py; the sources in csrc/, the signatures in bindings.py.

The library is loaded with ctypes after torch, so its OpenMP pragmas run on the runtime torch already
loaded. Which library (`EngineConfig.kernel_variant`): a wheel's prebuilt variant for this CPU's level
(kernel_variants.py) or the first-use -march=native build; with neither, the worker keeps the torch
paths: slower, the same numbers to float rounding.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import subprocess
from pathlib import Path

import numpy as np
import torch

from coreserve.worker.cpu.bindings import CpuKernels, bind
from coreserve.worker.cpu.build import NATIVE, find_compiler, load_library
from coreserve.worker.cpu.kernel_variants import (
    HEADERS,
    LIBRARY_NAME,
    PREBUILT,
    SOURCES,
    KernelVariant,
    choose_variant,
    cpu_features,
    prebuilt_variants,
)

logger = logging.getLogger(__name__)


def load_cpu_kernels(
    cache_dir: Path | None = None,
    extra_flags: tuple[str, ...] = (),
    setting: str = "native",
    prebuilt_dir: Path = PREBUILT,
) -> CpuKernels | None:
    """The kernels, or None (with a warning) when none can be had here. setting: `EngineConfig.kernel_variant`
    ("native", the default here: the first-use -march=native build, extra_flags after its flags; "auto":
    this CPU's best prebuilt variant, else native; a variant's name: that one, prebuilt or else built
    here, a ValueError where the CPU cannot run it or it can be neither loaded nor built).
    prebuilt_dir: where the variants lie (the package's own folder)."""
    variant = choose_variant(setting, cpu_features(), prebuilt_variants(prebuilt_dir))
    pinned = variant.name if variant is not None and setting == variant.name else None
    library = _open_prebuilt(prebuilt_dir, variant) if variant is not None else None
    if library is not None:
        how = f"prebuilt variant {variant.name}"
    else:
        variant = variant if pinned else None  # "auto" whose prebuilt one would not load: the native build
        target = variant.target if variant is not None else NATIVE
        library = _build_here(target, cache_dir, extra_flags, pinned)
        how = f"built here with {' '.join(target + extra_flags)}"
    if library is None:
        return None
    try:
        kernels = bind(library)
    except AttributeError as exc:
        return _refuse(pinned, f"a function is missing ({exc})")
    if variant is not None and not variant.has_bf16_dot:  # the variant's bf16 product on every CPU
        kernels = dataclasses.replace(kernels, has_bf16_dot=False)
    logger.info("CPU kernels: %s (kernel_variant=%s)", how, setting)
    return kernels


def _open_prebuilt(folder: Path, variant: KernelVariant) -> ctypes.CDLL | None:
    """The variant's library from the package; None (with a warning) where it is absent or will not load,
    e.g. with no OpenMP runtime in the process's global scope to bind to."""
    path = folder / variant.name / LIBRARY_NAME
    if not path.is_file():
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        logger.warning("prebuilt kernels %s do not load (%s): building them here", variant.name, exc)
        return None


def _build_here(
    target: tuple[str, ...], cache_dir: Path | None, extra_flags: tuple[str, ...], pinned: str | None
) -> ctypes.CDLL | None:
    """The first-use build for target, or what _refuse says where it cannot be had."""
    compiler = find_compiler()
    if compiler is None:
        missing = "" if target == NATIVE else " and the install has no such library"
        return _refuse(pinned, f"no C compiler found{missing}")
    try:
        return load_library("cpu_kernels", SOURCES, HEADERS, compiler, cache_dir, extra_flags, target)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
        return _refuse(pinned, f"the build failed ({exc})")


def _refuse(pinned: str | None, reason: str) -> None:
    """A ValueError for a pinned variant (a fleet that pinned one must not run another, nor torch's paths,
    unnoticed); else a warning and None: the torch paths."""
    if pinned is not None:
        raise ValueError(f"kernel_variant={pinned!r} cannot be had here: {reason}; install a wheel that "
                         "carries it, or a C compiler to build it")
    logger.warning("CPU kernels unavailable: %s; attention and logprobs run on the slower torch paths", reason)
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
    sinks: torch.Tensor | None = None,
) -> None:
    """q, out: [T, Hq, D] float32 contiguous; cache: [2, Hkv, slots, D]; rows [R] int64, block_tables
    [R, max_blocks] int32, context_lens [R] int32 numpy arrays (C-contiguous); window: a sliding
    window (each row attends to its last `window` positions), 0 for none; pointers: the three
    arrays' addresses where the caller has them already; softcap: Gemma 2's cap on the scores, 0 none;
    sinks: [Hq] float32, a logit a head joining each softmax (gpt-oss), None for none."""
    assert q.is_contiguous() and out.is_contiguous() and cache.is_contiguous() and q.dtype == torch.float32
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.numel() == q.shape[1])
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
        None if sinks is None else sinks.data_ptr(),
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


def sigmoid(kernels: CpuKernels, x: torch.Tensor) -> torch.Tensor:
    """x: float32 -> 1 / (1 + exp(-x)), an element's bits the same wherever it sits in x."""
    x = x.contiguous()
    assert x.dtype == torch.float32
    out = torch.empty_like(x)
    kernels.sigmoid(x.data_ptr(), x.numel(), out.data_ptr())
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


def gated_deltanet(kernels: CpuKernels, mixer, proj: torch.Tensor, state, spans) -> torch.Tensor:
    """A Gated DeltaNet layer's mixer (coreserve/worker/models/gated_deltanet.py's module, its params fp32)
    over proj [T, width] float32, one C call a sequence (`spans`: StateSpan), each from and to its
    state slot (`state`: LayerState) -> [T, value_dim]."""
    lin = mixer.shape
    out, scratch, taps = _span_buffers(mixer, proj, spans, lin.conv_dim, lin.conv_kernel, mixer.value_dim)
    params = _pointers(taps, mixer.A_log, mixer.dt_bias, mixer.norm.weight)
    for first, num, slot in spans:
        status = kernels.gated_deltanet_span(
            proj[first].data_ptr(), proj.shape[1], num, state.conv[slot].data_ptr(), state.recurrent[slot].data_ptr(),
            *params, mixer.eps, lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim,
            lin.conv_kernel, scratch.data_ptr(), out[first].data_ptr(), torch.get_num_threads(),
        )
        _check_span(status, "gated_deltanet_span", lin)
    return out


def mamba2(kernels: CpuKernels, mixer, proj: torch.Tensor, state, spans) -> torch.Tensor:
    """A Mamba2 layer's mixer (coreserve/worker/models/mamba2.py's module, its params fp32) over proj [T, width]
    float32, one C call a sequence (`spans`: StateSpan), each from and to its state slot -> [T, inner]."""
    m, bias = mixer.shape, mixer.conv1d.bias
    out, scratch, taps = _span_buffers(mixer, proj, spans, m.conv_dim, m.conv_kernel, m.inner)
    taps_ptr, *params = _pointers(taps, mixer.A_log, mixer.dt_bias, mixer.D, mixer.norm.weight)
    bias_ptr = None if bias is None else _pointers(bias)[0]
    for first, num, slot in spans:
        status = kernels.mamba2_span(
            proj[first].data_ptr(), proj.shape[1], num, state.conv[slot].data_ptr(), state.recurrent[slot].data_ptr(),
            taps_ptr, bias_ptr, *params, mixer.eps, m.num_heads, m.head_dim, m.num_groups, m.state_size,
            m.conv_kernel, scratch.data_ptr(), out[first].data_ptr(), torch.get_num_threads(),
        )
        _check_span(status, "mamba2_span", m)
    return out


def _span_buffers(mixer, proj: torch.Tensor, spans, conv_dim: int, kernel: int, width: int):
    """A recurrent mixer's out [T, width], its conv scratch (the longest span's rows) and the conv's taps
    [kernel, conv_dim] (transposed once a layer a step, not a sequence)."""
    assert proj.is_contiguous() and proj.dtype == torch.float32
    out = torch.empty(proj.shape[0], width)
    scratch = torch.empty(max((num for _, num, _ in spans), default=0), conv_dim)
    return out, scratch, mixer.conv1d.weight.reshape(conv_dim, kernel).t().contiguous()


def _pointers(*tensors: torch.Tensor) -> list[int]:
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)  # apply_cpu_backend's widening
    return [t.data_ptr() for t in tensors]


def _check_span(status: int, name: str, shape) -> None:
    if status != 0:
        raise RuntimeError(f"{name} refused the shapes {shape} (status {status})")
