"""The C few-row products (coreserve/worker/cpu/csrc/gemv.c through coreserve/worker/cpu/linear.gemv) against float64 references of
torch's ops, on odd shapes, one row and many; bf16 with the dot instruction and the forced fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coreserve.worker.cpu.kernels import load_cpu_kernels
from coreserve.worker.cpu.linear import gemv

SHAPES = [(1, 1), (5, 17), (37, 45), (100, 768), (67, 1000)]  # (out, in): tails past 4, 16 and 32
ROWS = [1, 2, 3, 4, 5, 8, 16, 33]  # 1-4: one weight row at a time; 5 on: blocks of four


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels()
    assert loaded is not None, "this machine has a C compiler: the kernels must build"
    return loaded


def operands(num_rows: int, num_out: int, num_in: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, num_in, generator=generator)
    weight = torch.randn(num_out, num_in, generator=generator)
    return x, weight, torch.randn(num_out, generator=generator)


def relative_error(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> float:
    """Worst |actual - exact| over the row's sum of |products|: what fp32 summation may lose."""
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T + (0 if bias is None else bias.double())
    scale = x64.abs() @ w64.abs().T + (1e-30 if bias is None else bias.double().abs())
    return ((actual.double() - exact).abs() / scale).max().item()


@pytest.mark.parametrize("num_out, num_in", SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_fp32_product_matches_torch_to_fp32_rounding(kernels, num_out, num_in, has_bias):
    for num_rows in ROWS:
        x, weight, bias = operands(num_rows, num_out, num_in, seed=num_rows)
        bias = bias if has_bias else None
        actual = gemv(kernels, x, weight, bias)
        assert actual.shape == (num_rows, num_out) and actual.dtype == torch.float32
        assert relative_error(actual, x, weight, bias) < 1e-6 * max(1.0, num_in**0.5)
        torch.testing.assert_close(actual, torch.nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_out, num_in", SHAPES)
@pytest.mark.parametrize("use_dot", [True, False])
def test_bf16_product_is_bf16_products_summed_in_fp32(kernels, num_out, num_in, use_dot):
    """x rounded to bf16 (to nearest even, as torch rounds), times the bf16 weights, summed in fp32:
    with the dot instruction and with the widening fallback alike."""
    for num_rows in ROWS:
        x, weight, bias = operands(num_rows, num_out, num_in, seed=num_rows)
        weight = weight.to(torch.bfloat16)
        actual = gemv(kernels, x, weight, bias, use_bf16_dot=use_dot)
        rounded_x = x.to(torch.bfloat16)
        assert relative_error(actual, rounded_x, weight, bias) < 1e-6 * max(1.0, num_in**0.5)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7])
def test_every_tail_length_matches_float64(kernels, num_rows):
    """Inputs 1 to 140 wide: every remainder of the unrolled loops (4 vectors of 16 or 8 lanes, 2 of
    8 past two rows on AVX2, a vector, single columns), fp32 and bf16 weights, with the fallback."""
    for num_in in range(1, 141):
        x, weight, bias = operands(num_rows, 9, num_in, seed=num_in)
        actual = gemv(kernels, x, weight, bias)
        assert relative_error(actual, x, weight, bias) < 1e-6 * max(1.0, num_in**0.5), num_in
        for use_dot in (True, False):
            actual = gemv(kernels, x, weight.to(torch.bfloat16), bias, use_bf16_dot=use_dot)
            rounded = (x.to(torch.bfloat16), weight.to(torch.bfloat16))
            assert relative_error(actual, *rounded, bias) < 1e-6 * max(1.0, num_in**0.5), num_in


def test_dot_instruction_and_fallback_agree_to_fp32_rounding(kernels):
    x, weight, _ = operands(7, 300, 2048, seed=1)
    weight = weight.to(torch.bfloat16)
    with_dot = gemv(kernels, x, weight, None, use_bf16_dot=True)
    widened = gemv(kernels, x, weight, None, use_bf16_dot=False)
    torch.testing.assert_close(with_dot, widened, rtol=1e-5, atol=1e-4)


def test_bf16_dot_is_used_only_where_the_cpu_has_it(kernels):
    """Detected at run time; the flag /proc/cpuinfo lists must agree with what the kernel found."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "flags" not in cpuinfo.read_text():
        pytest.skip("no x86 /proc/cpuinfo here")
    flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split()
    assert kernels.has_bf16_dot == ("avx512_bf16" in flags and "avx512bw" in flags)
    assert bool(kernels.cpu_has_bf16_dot()) == kernels.has_bf16_dot


def test_nan_and_infinity_in_activations_propagate(kernels):
    x, weight, _ = operands(2, 20, 40, seed=2)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    for w in (weight, weight.to(torch.bfloat16)):
        out = gemv(kernels, x, w, None)
        assert out[0].isnan().all() and not out[1].isfinite().any()


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5])
def test_sums_do_not_depend_on_the_thread_count(kernels, num_rows):
    """Each thread reads its features as two streams (the first and second half of its share), so which
    features pair up changes with the thread count; every output must be summed the same way."""
    x, weight, bias = operands(num_rows, 1031, 768, seed=num_rows)
    threads = torch.get_num_threads()
    try:
        results = {}
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            results[num_threads] = [gemv(kernels, x, w, bias) for w in (weight, weight.to(torch.bfloat16))]
    finally:
        torch.set_num_threads(threads)
    for num_threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(results[num_threads], results[1]))


@pytest.mark.parametrize("use_dot", [True, False])
@pytest.mark.parametrize("num_out, num_in", [(37, 45), (100, 768), (67, 1000)])
def test_each_row_gets_the_same_bits_at_every_row_count(kernels, num_out, num_in, use_dot):
    """Batch invariance: one order of summation per output, whatever the row count (the one-row stream,
    the 2-4 row streams, the 4x4 blocks and panels of many rows) and the thread count."""
    x, weight, bias = operands(300, num_out, num_in, seed=num_in)
    threads = torch.get_num_threads()
    try:
        for w in (weight, weight.to(torch.bfloat16)):
            alone = torch.cat([gemv(kernels, x[i : i + 1], w, bias, use_dot) for i in range(0, 300, 7)])
            for num_rows in (*ROWS, 17, 64, 300):
                for num_threads in (1, 2):
                    torch.set_num_threads(num_threads)
                    together = gemv(kernels, x[:num_rows], w, bias, use_dot)
                    assert torch.equal(together[::7], alone[: len(together[::7])]), (w.dtype, num_rows)
    finally:
        torch.set_num_threads(threads)
