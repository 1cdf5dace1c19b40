"""The C products of weights kept in a GGUF block format (csrc/gemv_quant.c; integer mode's
csrc/gemv_int8.c), and the C dequantization of such rows (engine-core process).

Every row count takes the one kernel, whose sums are bit for bit gemv_f32's on the dequantized weights
(one order per output: batch invariant whatever `is_batch_invariant` says; there is no MKL path to
take, since MKL would need the weights in fp32). In integer mode (`is_int8`) the activations are
quantized to int8 blocks in C and the sums run in integers, again in one order per output at any row
count. docs/quantized.md.
"""

from __future__ import annotations

import ctypes

import torch

from coreserve.worker.cpu.bindings import CpuKernels, QuantPart
from coreserve.worker.models.quantized import QUANT_PARTS, QUANT_TYPES, QuantLinear, row_bytes, row_runs

_ROW_CHUNK = 256  # rows per call, as linear.py's chunks: the activations stay in cache per weight tile


def quant_gemv(
    kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None,
    is_int8: bool = False,
) -> torch.Tensor:
    """x: [R, K] float32; weight: [N, K / 32 * block bytes] uint8 blocks of `ggml_type` (QUANT_PARTS: the
    flat runs of coreserve/worker/models/quantized.py); bias: [N] or None. Returns [R, N] float32. `is_int8`:
    integer mode's product (x quantized to int8 blocks)."""
    if not x.is_contiguous():
        x = x.contiguous()
    num_rows, num_in = x.shape
    assert x.dtype == torch.float32 and weight.dtype == torch.uint8 and weight.is_contiguous()
    if ggml_type == QUANT_PARTS:
        num_out, pointer = sum(rows for rows, _ in weight.ggml_parts), part_array_address(weight)
        assert weight.ggml_width == num_in, (weight.ggml_width, num_in)
    else:
        num_out, pointer = weight.shape[0], weight.data_ptr()
        if ggml_type in QUANT_TYPES and weight.shape[1] != row_bytes(ggml_type, num_in):  # the C reads K's bytes
            raise ValueError(f"weight rows of {weight.shape[1]} bytes do not hold rows of {num_in} values "
                             f"of ggml type {ggml_type} ({row_bytes(ggml_type, num_in)} bytes)")
    out = torch.empty(num_rows, num_out)
    bias_ptr = None if bias is None else bias.float().contiguous().data_ptr()
    product = kernels.gemv_int8 if is_int8 else kernels.gemv_quant
    status = product(x.data_ptr(), num_rows, num_in, pointer, ggml_type, num_out, bias_ptr, out.data_ptr(),
                     torch.get_num_threads())
    if status == -2:
        raise ValueError(f"no product for ggml type {ggml_type} with rows of {num_in} values")
    if status != 0:
        raise MemoryError("the quantized product could not allocate its scratch memory")
    return out


def part_array_address(weight: torch.Tensor) -> int:
    """The address of a QUANT_PARTS weight's struct quant_part array (its runs, then one of 0 rows), made
    once for the weight's current memory and kept on it."""
    made = getattr(weight, "quant_part_array", None)
    if made is None or made[0] != weight.data_ptr():
        runs = row_runs(weight)
        array = (QuantPart * (len(runs) + 1))(*(QuantPart(run.data_ptr(), t, run.shape[0]) for t, run in runs))
        made = weight.quant_part_array = (weight.data_ptr(), array)
    return ctypes.addressof(made[1])


def quant_linear(kernels: CpuKernels, layer: QuantLinear, x: torch.Tensor, is_int8: bool = False) -> torch.Tensor:
    """x: [T, in] float32 -> [T, out] float32, `_ROW_CHUNK` rows a call (each row's sums are the same
    in any chunk)."""
    parts = [quant_gemv(kernels, x[start : start + _ROW_CHUNK], layer.weight, layer.ggml_type, layer.bias, is_int8)
             for start in range(0, x.shape[0], _ROW_CHUNK)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def dequantize_rows(kernels: CpuKernels, raw: torch.Tensor, ggml_type: int, num_in: int) -> torch.Tensor:
    """raw [R, row bytes] uint8 -> [R, num_in] float32, the values the products use."""
    raw = raw.contiguous()
    out = torch.empty(raw.shape[0], num_in)
    status = kernels.dequantize_rows(raw.data_ptr(), ggml_type, raw.shape[0], num_in, out.data_ptr())
    if status != 0:
        raise ValueError(f"no dequantization for ggml type {ggml_type} with rows of {num_in} values")
    return out
