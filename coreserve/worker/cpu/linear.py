"""The linear layers' products, x @ W^T + b, by device, dtype and row count (engine-core process).

On the CPU with the C kernels, batch invariant (the default): every row count takes the C kernel of
`gemv.c`, whose sums run in one order per output, so a row's numbers do not depend on its batch.
Otherwise (`batch_invariant=False`): up to `GEMV_MAX_ROWS` rows (decode) the weights are streamed once by
the kernel in `gemv.c`, both cores busy, fp32 weights or bf16 (bf16 x bf16 products summed in fp32,
x rounded to bf16). Past that, fp32 weights take MKL the transposed way (W @ x^T, faster than
x @ W^T up to a few hundred rows) and then plain `F.linear`; bf16 weights stay with the C kernel
where the CPU has AVX512-BF16 (its dot instruction beats MKL's fp32 products at any row count),
elsewhere they are widened to fp32 a block of output features at a time for MKL (torch's own bf16
products run far slower than its fp32 ones on this CPU). Without kernels (CUDA, no compiler) it is
`F.linear` in the weights' dtype. Weights kept in a GGUF file's blocks take csrc/gemv_quant.c
(coreserve/worker/cpu/quant_linear.py) at every row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coreserve.worker.cpu.kernels import CpuKernels
from coreserve.worker.cpu.quant_linear import quant_linear
from coreserve.worker.models.quantized import QuantLinear

GEMV_MAX_ROWS = 16  # rows up to which the C fp32 product beats MKL (scripts/bench_gemv.py)
_ROW_CHUNK = 256  # rows per bf16 dot product call, so the activations stay in cache per weight block
_FEW_ROWS = 128  # up to here MKL's transposed product wins on this CPU; past it the copy back costs more
_OUT_CHUNK = 4096  # output features per product, so the transpose back reads from cache (lm_head: 2x)
AMX_MIN_ROWS = 17  # bf16 weights from here on take the AMX tiles, where the CPU has them


def gemv(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         use_bf16_dot: bool | None = None) -> torch.Tensor:
    """x: [R, K] float32; weight: [N, K] float32 or bfloat16, contiguous; bias: [N] float32 or None.
    Returns [R, N] float32. `use_bf16_dot`: None takes the dot instruction where the CPU has it;
    False forces the widening path (tests)."""
    if not x.is_contiguous():
        x = x.contiguous()
    (num_rows, num_in), num_out, dtype = x.shape, weight.shape[0], weight.dtype
    assert x.dtype == torch.float32 and weight.is_contiguous() and num_in == weight.shape[1]
    out = torch.empty(num_rows, num_out)
    bias_ptr = None if bias is None else bias.float().contiguous().data_ptr()
    threads = torch.get_num_threads()
    if dtype == torch.float32:
        kernels.gemv_f32(x.data_ptr(), num_rows, num_in, weight.data_ptr(), num_out, bias_ptr,
                         out.data_ptr(), threads)
        return out
    assert dtype == torch.bfloat16
    use_dot = kernels.has_bf16_dot if use_bf16_dot is None else use_bf16_dot and kernels.has_bf16_dot
    status = kernels.gemv_bf16(x.data_ptr(), num_rows, num_in, weight.data_ptr(), num_out, bias_ptr,
                               out.data_ptr(), int(use_dot), threads)
    if status != 0:
        raise MemoryError("the bf16 product could not allocate its scratch memory")
    return out


def amx_product(
    kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x: [R, K] float32, K a multiple of 32; weight: [N, K] bfloat16, contiguous. Returns [R, N] float32:
    gemm_amx.c's tile products for whole runs of 32 features, the few-row kernel for the rest."""
    if not x.is_contiguous():
        x = x.contiguous()
    (num_rows, num_in), num_out = x.shape, weight.shape[0]
    assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and num_in % 32 == 0
    out = torch.empty(num_rows, num_out)
    bias_ptr = None if bias is None else bias.float().contiguous().data_ptr()
    status = kernels.gemm_bf16_amx(x.data_ptr(), num_rows, num_in, weight.data_ptr(), num_out, bias_ptr,
                                   out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("the AMX product could not allocate its scratch memory")
    tail = num_out % 32
    if tail:
        out[:, num_out - tail :] = gemv(
            kernels, x, weight[num_out - tail :], None if bias is None else bias[num_out - tail :]
        )
    return out


def linear(
    layer: nn.Linear, x: torch.Tensor, kernels: CpuKernels | None = None, is_batch_invariant: bool = False,
    is_int8: bool = False,
) -> torch.Tensor:
    """x: [T, in] -> [T, out]. `kernels` are only ever loaded on the CPU; with them x is float32 and
    the weights float32 or bf16. `is_batch_invariant`: every row count takes gemv.c, whose sums run in
    one order per output whatever the rows (no MKL, no AMX: their orders depend on the shape).
    `is_int8`: GGUF blocks take integer mode's products (the float weights are unchanged)."""
    if kernels is None:
        return layer(x)
    if isinstance(layer, QuantLinear):  # GGUF blocks: one kernel, one order of summation, any row count
        return quant_linear(kernels, layer, x, is_int8)
    if x.shape[0] <= GEMV_MAX_ROWS:
        return gemv(kernels, x, layer.weight, layer.bias)
    is_bf16 = layer.weight.dtype == torch.bfloat16
    if is_batch_invariant:
        return _row_chunks(kernels, layer, x)
    if is_bf16 and kernels.has_amx and x.shape[0] >= AMX_MIN_ROWS and layer.in_features % 32 == 0:
        return amx_product(kernels, x, layer.weight, layer.bias)
    if is_bf16 and kernels.has_bf16_dot:  # faster than MKL's fp32 products at any row count
        return _row_chunks(kernels, layer, x)
    if is_bf16:
        return _widened_linear(layer, x)
    return transposed_linear(layer, x)


def _row_chunks(kernels: CpuKernels, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """gemv.c on `_ROW_CHUNK` rows at a time (each row's sums are the same in any chunk)."""
    parts = [gemv(kernels, x[start : start + _ROW_CHUNK], layer.weight, layer.bias)
             for start in range(0, x.shape[0], _ROW_CHUNK)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _widened_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """bf16 weights, many rows: fp32 products of the weights widened one block at a time, x rounded
    to bf16 as the C kernel does (a request's numbers must not depend on its batch's row count)."""
    weight, bias = layer.weight, layer.bias
    x = x.to(torch.bfloat16).float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], _OUT_CHUNK):
        features = slice(start, start + _OUT_CHUNK)
        part_bias = None if bias is None else bias[features].float()
        out[:, features] = F.linear(x, weight[features].float(), part_bias)
    return out


def transposed_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """fp32, 17 to a few hundred rows: MKL runs W @ x^T faster than x @ W^T (the same products, summed
    in another order); the vocabulary-wide lm_head keeps winning up to 256 rows, the smaller layers
    stop at 128 (docs/benchmarks.md)."""
    num_rows = x.shape[0]
    few_rows = 2 * _FEW_ROWS if layer.out_features > 4 * _OUT_CHUNK else _FEW_ROWS
    if num_rows > few_rows:
        return layer(x)
    weight, bias, x_t = layer.weight, layer.bias, x.t()
    out = torch.empty(num_rows, weight.shape[0], dtype=x.dtype)
    for start in range(0, weight.shape[0], _OUT_CHUNK):
        features = slice(start, start + _OUT_CHUNK)
        if bias is None:
            part = torch.mm(weight[features], x_t)  # [chunk, rows]
        else:
            part = torch.addmm(bias[features].unsqueeze(1), weight[features], x_t)
        out[:, features] = part.t()
    return out
