"""The C products of GGUF block weights (coreserve/worker/cpu/csrc/gemv_quant.c through coreserve/worker/cpu/quant_linear.py):
their dequantization is gguf's numpy one bit for bit, and their products are gemv_f32's on those values
bit for bit (torch.equal) for every row count 1..40 and prefill sizes, one thread and two, and within
fp32 rounding of float64. The kernels build for the CPU they run on, so the builds for narrower x86
instruction sets (AVX2, AVX, generic vector code) are built here too and held to the same."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf_files import K_SCALE_FIELDS

from coreserve.worker.cpu.build import NARROWER_BUILDS
from coreserve.worker.cpu.kernels import load_cpu_kernels
from coreserve.worker.cpu.linear import gemv
from coreserve.worker.cpu.quant_linear import dequantize_rows, quant_gemv
from coreserve.worker.models.finite_weights import is_finite
from coreserve.worker.models.quantized import (
    MXFP4,
    QUANT_PARTS,
    QUANT_TYPES,
    QuantLinear,
    block_values,
    dequantize,
)

TYPES = sorted(QUANT_TYPES)  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4
SHAPES = [(37, 96), (100, 576), (67, 1536)]  # (out, in): odd feature counts, SmolLM2's widths
K_SHAPES = [(37, 256), (100, 768), (67, 1536)]  # whole 256-weight super-blocks
WIDTH = {2: 576, 3: 576, 8: 576, 12: 768, 13: 768, 14: 768, 39: 576}  # a width of whole blocks for each type
# byte offsets of each block's fp16 scale fields: d (and Q4_1's m, the K-quants' dmin, as gguf_files has them)
SCALE_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 39: (), **{t: K_SCALE_FIELDS[QUANT_TYPES[t][0]] for t in (12, 13, 14)}}
ROWS = [*range(1, 41), 83, 300]  # decode sizes, then panels of many rows past a 256-row chunk
# Each path of gemv_quant.c that the native build of an AVX-512 host does not take; on a narrower host
# a build may equal the native one, and is checked all the same.


def random_blocks(ggml_type: int, num_out: int, num_in: int, seed: int) -> torch.Tensor:
    """[num_out, row bytes] uint8: random quants (and K-quant sub-block scales and mins), fp16 scales of
    every sign and size (subnormals too, and extremes: the largest fp16 and the smallest normal),
    offsets of either sign; MXFP4's scale bytes near 2^0 with extremes (fp32 subnormal scales, 2^72);
    the bytes a file may hold, not only what a quantizer writes."""
    rng = np.random.default_rng(seed)
    _, block_bytes, block_weights = QUANT_TYPES[ggml_type]
    num_blocks = num_in // block_weights
    blocks = rng.integers(0, 256, (num_out, num_blocks, block_bytes), dtype=np.uint8)
    if ggml_type == MXFP4:  # no fp16 fields: its scale byte e, 2^(e - 128)
        scales = rng.integers(110, 140, (num_out, num_blocks), dtype=np.uint8)
        scales.flat[::7], scales.flat[3::11], scales.flat[5::13], scales.flat[6::17] = 0, 200, 1, 2
        blocks[:, :, 0] = scales
    for offset in SCALE_FIELDS[ggml_type]:
        scales = (rng.standard_normal((num_out, num_blocks)) * 0.05).astype(np.float16)
        scales.flat[::7] = np.float16(3e-7)  # subnormal fp16
        scales.flat[3::11] = np.float16(-65504.0)  # the largest finite fp16
        scales.flat[5::13] = np.float16(6.1035e-05)  # the smallest normal fp16
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(num_out, -1, 2)
    return torch.from_numpy(blocks.reshape(num_out, -1))


def shapes_of(ggml_type: int) -> list[tuple[int, int]]:
    return K_SHAPES if QUANT_TYPES[ggml_type][2] == 256 else SHAPES


@pytest.mark.parametrize("ggml_type", TYPES)
def test_c_dequantization_is_ggufs_bit_for_bit(kernels, ggml_type):
    width = WIDTH[ggml_type]
    raw = random_blocks(ggml_type, 64, width, seed=ggml_type)
    expected = dequantize(raw, ggml_type)
    assert torch.isfinite(expected).all() and expected.abs().max() > 1e3  # the extreme scales are in
    assert torch.equal(dequantize_rows(kernels, raw, ggml_type, width), expected)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("shape", [0, 1, 2])
def test_product_equals_the_fp32_kernel_on_the_dequantized_weights_for_every_row_count(kernels, ggml_type, shape):
    num_out, num_in = shapes_of(ggml_type)[shape]
    raw = random_blocks(ggml_type, num_out, num_in, seed=num_out)
    weight = dequantize(raw, ggml_type)
    assert_every_row_count_is_gemv_f32s(kernels, raw, ggml_type, weight, seed=num_in)


def assert_every_row_count_is_gemv_f32s(kernels, raw: torch.Tensor, ggml_type: int, weight: torch.Tensor,
                                        seed: int) -> None:
    """quant_gemv of `raw` equals gemv_f32 on its values `weight`, for every count in ROWS, with and
    without a bias, on one thread and two."""
    generator = torch.Generator().manual_seed(seed)
    x_all = torch.randn(max(ROWS), weight.shape[1], generator=generator)
    bias = torch.randn(weight.shape[0], generator=generator)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for num_rows in ROWS:
                x = x_all[:num_rows]
                for b in (None, bias):
                    ours = quant_gemv(kernels, x, raw, ggml_type, b)
                    assert torch.equal(ours, gemv(kernels, x, weight, b)), (num_threads, num_rows, b is None)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_product_is_within_fp32_rounding_of_float64_and_each_row_its_own(kernels, ggml_type):
    num_out, num_in = 100, WIDTH[ggml_type]
    raw = random_blocks(ggml_type, num_out, num_in, seed=3)
    weight = dequantize(raw, ggml_type).double()
    x = torch.randn(40, num_in, generator=torch.Generator().manual_seed(4))
    ours = quant_gemv(kernels, x, raw, ggml_type, None)
    exact = x.double() @ weight.T
    scale = x.double().abs() @ weight.abs().T
    assert ((ours.double() - exact).abs() / scale).max().item() < 1e-6 * num_in**0.5
    for row in (0, 17, 39):  # a row's numbers do not depend on its batch
        assert torch.equal(quant_gemv(kernels, x[row : row + 1], raw, ggml_type, None), ours[row : row + 1])


def test_runs_of_rows_of_different_types_equal_the_fp32_kernel_on_their_values(kernels):
    """A fused projection of several types (QUANT_PARTS): Q4_K q and k rows, then Q6_K v rows, then a
    Q8_0 run, flat; each output its own run's sums, at every row count, one thread and two. The runs'
    lengths are no multiple of the threads' 4-row shares, so a share crosses a run's end."""
    num_in, parts = 768, ((37, 12), (22, 14), (9, 8))
    layer = QuantLinear(num_in, sum(rows for rows, _ in parts), parts)
    runs = [random_blocks(t, rows, num_in, seed=rows) for rows, t in parts]
    layer.weight.data.copy_(torch.cat([run.flatten() for run in runs]))
    weight = block_values(layer.weight)
    assert layer.ggml_type == QUANT_PARTS and torch.equal(weight, torch.cat([dequantize(r, t) for r, (_, t) in
                                                                             zip(runs, parts)]))
    assert_every_row_count_is_gemv_f32s(kernels, layer.weight, QUANT_PARTS, weight, seed=11)


def test_mxfp4_blocks_whose_values_overflow_are_refused_as_their_dequantization_is_not_finite(kernels):
    """MXFP4's scale is a power of two, 2^(e - 128) times the doubled value: from e = 253 a large enough
    nibble overflows fp32 (e = 255, e8m0's NaN, read as ggml, gguf and transformers read it). A weight is
    refused exactly where gguf's dequantization holds an infinity; what is kept, the C reads the same."""
    cases = [(252, 0x77), (253, 0x55), (253, 0x66), (254, 0x33), (254, 0x44), (255, 0x11), (255, 0x22),
             (255, 0x99), (255, 0x00), (0, 0xFF)]  # (scale byte, every nibble byte): 7 is 12, 5 is 6, 9 is -1
    for scale, nibbles in cases:
        raw = random_blocks(MXFP4, 3, 64, seed=scale)
        raw[1, 17] = scale  # the second row's second block
        raw[1, 18:34] = nibbles
        with np.errstate(over="ignore"):
            values, layer = dequantize(raw, MXFP4), QuantLinear(64, 3, MXFP4)
        layer.weight.data.copy_(raw)
        assert is_finite(layer.weight) == bool(torch.isfinite(values).all()), (scale, nibbles)
        if torch.isfinite(values).all():
            assert torch.equal(dequantize_rows(kernels, raw, MXFP4, 64), values)
    with np.errstate(over="ignore"):
        finite = [bool(torch.isfinite(dequantize(_one_block(s, n), MXFP4)).all()) for s, n in cases]
    assert finite == [
        True, True, False, True, False, True, False, True, True, True]


def _one_block(scale: int, nibbles: int) -> torch.Tensor:
    return torch.tensor([[scale] + [nibbles] * 16], dtype=torch.uint8)


def test_unsupported_types_and_widths_are_refused(kernels):
    raw = random_blocks(8, 4, 64, seed=0)
    with pytest.raises(ValueError, match="ggml type 11"):  # Q3_K: dequantized at load, no product here
        quant_gemv(kernels, torch.randn(1, 64), raw, 11, None)
    k_raw = random_blocks(12, 4, 256, seed=0)
    with pytest.raises(ValueError, match="rows of 128 values"):  # half a super-block
        quant_gemv(kernels, torch.randn(1, 128), k_raw, 12, None)
    with pytest.raises(ValueError, match="rows of 48 values"):
        quant_gemv(kernels, torch.randn(1, 48), raw, 8, None)
    with pytest.raises(ValueError, match="rows of 96 values"):  # the C would read past each 2-block row
        quant_gemv(kernels, torch.randn(1, 96), raw, 8, None)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set flags")
@pytest.mark.parametrize("build", sorted(NARROWER_BUILDS))
def test_builds_for_narrower_instruction_sets_keep_their_fp32_kernels_sums(build):
    """Each build against its own gemv_f32: its lanes, and so the order of its sums, are its own."""
    narrow = load_cpu_kernels(extra_flags=NARROWER_BUILDS[build])
    assert narrow is not None, f"the {build} build failed"
    generator = torch.Generator().manual_seed(7)
    x_all, bias = torch.randn(40, 768, generator=generator), torch.randn(67, generator=generator)
    threads = torch.get_num_threads()
    try:
        for ggml_type in TYPES:
            width = WIDTH[ggml_type]
            raw = random_blocks(ggml_type, 67, width, seed=ggml_type)
            weight = dequantize(raw, ggml_type)
            assert torch.equal(dequantize_rows(narrow, raw, ggml_type, width), weight)
            for num_threads in (1, 2):
                torch.set_num_threads(num_threads)
                for num_rows in (1, 2, 3, 4, 5, 8, 32, 33, 40):  # passes of rows, then panels
                    x = x_all[:num_rows, :width]
                    for b in (None, bias):
                        ours, fp32 = quant_gemv(narrow, x, raw, ggml_type, b), gemv(narrow, x, weight, b)
                        assert torch.equal(ours, fp32), (ggml_type, num_threads, num_rows)
    finally:
        torch.set_num_threads(threads)
