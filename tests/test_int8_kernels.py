"""Integer mode's products (coreserve/worker/cpu/csrc/gemv_int8.c through quant_linear.py, quantized_activations=
"int8"): the C equals a numpy statement of the definition in docs/quantized.md bit for bit (the
activations' int8 blocks, integer sums, the fixed order of fused multiply-adds), the AVX512-VNNI code
equals the AVX2 code and the generic code of narrower builds bit for bit, and an output is the same bits at every row
count, split and thread count; the numbers stay near exact mode's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_quant_kernels import random_blocks

from coreserve.worker.cpu.build import NARROWER_BUILDS
from coreserve.worker.cpu.kernels import load_cpu_kernels
from coreserve.worker.cpu.quant_linear import quant_gemv
from coreserve.worker.models.quantized import MXFP4, QUANT_PARTS, QUANT_TYPES, QuantLinear

TYPES = sorted(QUANT_TYPES)  # Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4
WIDTHS = {2: 352, 3: 352, 8: 352, 12: 768, 13: 768, 14: 768, 39: 352}  # blocks of 32: 11, so a tail after 8
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])  # doubled e2m1, by nibble
ROWS = [1, 2, 3, 4, 5, 7, 9, 16, 17, 40, 300]


def plain_blocks(ggml_type: int, num_out: int, num_in: int, seed: int) -> torch.Tensor:
    """Random quants with small scales of both signs (no extremes: the numpy statement stays finite)."""
    raw = random_blocks(ggml_type, num_out, num_in, seed).numpy().copy()
    rng = np.random.default_rng(seed + 1)
    _, block_bytes, _ = QUANT_TYPES[ggml_type]
    blocks = raw.reshape(num_out, -1, block_bytes)
    if ggml_type == MXFP4:  # scale bytes: 2^-10 .. 2^-1 (the doubled values' 2^(e - 128))
        blocks[:, :, 0] = rng.integers(118, 128, blocks.shape[:2], dtype=np.uint8)
        return torch.from_numpy(raw)
    offsets = {14: (208,), 12: (0, 2), 13: (0, 2), 3: (0, 2)}.get(ggml_type, (0,))
    for offset in offsets:
        scales = (rng.standard_normal(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(num_out, -1, 2)
    return torch.from_numpy(raw)


# ---- the definition, in numpy ----

def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[R, K] float32 -> q [R, K / 32, 32] int64, d [R, K / 32] and d * sum(q) [R, K / 32] float32."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse[:, :, None]), -127, 127).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32)
    return q, d, (d * q.sum(axis=2).astype(np.float32)).astype(np.float32)


def half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 packed bytes [..., 12] -> 8 scales and 8 mins [..., 8]."""
    s = s.astype(np.int64)
    low = [s[..., j] & 63 for j in range(4)], [s[..., j + 4] & 63 for j in range(4)]
    high_sc = [(s[..., j + 8] & 15) | ((s[..., j] >> 6) << 4) for j in range(4)]
    high_m = [(s[..., j + 8] >> 4) | ((s[..., j + 4] >> 6) << 4) for j in range(4)]
    return np.stack(low[0] + high_sc, -1), np.stack(low[1] + high_m, -1)


def weight_integers(raw: np.ndarray, ggml_type: int, num_in: int):
    """-> the per-32 integer sums' weights and scales: (w [N, K / 32, 32] int64 signed values, scale
    [N, K / 32], offset [N, K / 32] or None, group scales [N, K / 32, 2] (Q6_K) or None)."""
    num_out = raw.shape[0]
    _, block_bytes, _ = QUANT_TYPES[ggml_type]
    b = raw.reshape(num_out, -1, block_bytes)
    if ggml_type == MXFP4:  # 2^(e - 128) times the doubled values, exact
        q = np.concatenate([b[:, :, 1:] & 15, b[:, :, 1:] >> 4], axis=2)
        scale = np.ldexp(np.float32(1), b[:, :, 0].astype(np.int32) - 128).astype(np.float32)
        return MXFP4_VALUES[q], scale, None, None
    if ggml_type in (2, 3, 8):
        scale = half(b[:, :, 0:2])
        if ggml_type == 8:
            return b[:, :, 2:34].view(np.int8).astype(np.int64), scale, None, None
        qs = b[:, :, 4:20] if ggml_type == 3 else b[:, :, 2:18]
        q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64)
        return (q, scale, half(b[:, :, 2:4]), None) if ggml_type == 3 else (q - 8, scale, None, None)
    if ggml_type == 14:
        ql, qh = b[:, :, 0:128].astype(np.int64), b[:, :, 128:192].astype(np.int64)
        q = np.zeros((num_out, b.shape[1], 256), np.int64)
        for h in range(2):
            for part in range(4):
                nibble = ql[:, :, 64 * h + 32 * (part % 2) : 64 * h + 32 * (part % 2) + 32]
                nibble = nibble & 15 if part < 2 else nibble >> 4
                pair = (qh[:, :, 32 * h : 32 * h + 32] >> (2 * part)) & 3
                q[:, :, 128 * h + 32 * part : 128 * h + 32 * part + 32] = (nibble | pair << 4) - 32
        groups = b[:, :, 192:208].view(np.int8).astype(np.int64).reshape(num_out, -1, 2)
        scale = np.repeat(half(b[:, :, 208:210]), 8, axis=1)
        return q.reshape(num_out, -1, 32), scale, None, groups
    sc, m = k_scales(b[:, :, 4:16])
    qs = b[:, :, 48:176] if ggml_type == 13 else b[:, :, 16:144]
    q = np.zeros((num_out, b.shape[1], 8, 32), np.int64)
    for sub in range(8):
        pair = qs[:, :, 32 * (sub // 2) : 32 * (sub // 2) + 32].astype(np.int64)
        q[:, :, sub] = pair >> 4 if sub % 2 else pair & 15
        if ggml_type == 13:
            q[:, :, sub] |= ((b[:, :, 16:48].astype(np.int64) >> sub) & 1) << 4
    scale = (half(b[:, :, 0:2])[:, :, None] * sc.astype(np.float32)).astype(np.float32)
    offset = ((-half(b[:, :, 2:4]))[:, :, None] * m.astype(np.float32)).astype(np.float32)
    return q.reshape(num_out, -1, 32), scale.reshape(num_out, -1), offset.reshape(num_out, -1), None


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c rounded once to float32 (a, b, c float32): the product is exact in float64, the sum's
    error is kept (TwoSum), and a tie between two float32 is broken by that error."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    back = s - p
    error = (p - (s - back)) + (c64 - back)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    toward = np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
    other = np.nextafter(r, toward)
    is_tie = (s != r64) & ((r64 + other.astype(np.float64)) / 2 == s)
    moves = is_tie & (error != 0) & (np.sign(error) == np.sign(other.astype(np.float64) - r64))
    return np.where(moves, other, r).astype(np.float32)


def reference_product(x: torch.Tensor, raw: torch.Tensor, ggml_type: int, bias: torch.Tensor | None) -> torch.Tensor:
    num_in = x.shape[1]
    q, d, ds = quantize_rows(x.numpy())
    w, scale, offset, groups = weight_integers(raw.numpy(), ggml_type, num_in)
    if groups is None:
        sums = np.einsum("rjk,njk->rnj", q, w)  # [R, N, blocks] int64, exact
    else:
        by_group = np.einsum("rjgk,njgk->rnjg", q.reshape(*q.shape[:2], 2, 16), w.reshape(*w.shape[:2], 2, 16))
        sums = (by_group * groups[None]).sum(axis=3)
    assert np.abs(sums).max() < 2**24
    acc = np.zeros((x.shape[0], raw.shape[0], 8), np.float32)
    for j in range(sums.shape[2]):
        step = (scale[None, :, j] * d[:, None, j]).astype(np.float32)
        acc[:, :, j % 8] = fma32(sums[:, :, j].astype(np.float32), step, acc[:, :, j % 8])
        if offset is not None:
            acc[:, :, j % 8] = fma32(np.broadcast_to(offset[None, :, j], step.shape).astype(np.float32),
                                     np.broadcast_to(ds[:, None, j], step.shape).astype(np.float32),
                                     acc[:, :, j % 8])
    a = acc
    out = ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + ((a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7]))
    if bias is not None:
        out = out + bias.numpy()
    return torch.from_numpy(out.astype(np.float32))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_c_product_is_the_numpy_statement_of_the_definition_bit_for_bit(kernels, ggml_type):
    num_in = WIDTHS[ggml_type]
    raw = plain_blocks(ggml_type, 29, num_in, seed=ggml_type)
    x = torch.randn(6, num_in, generator=torch.Generator().manual_seed(ggml_type))
    x[1, :40] = 0.0  # a block of zeros (and part of the next): d = 0, q = 0
    x[2] *= 1e-3
    bias = torch.randn(29)
    expected = reference_product(x, raw, ggml_type, bias)
    assert torch.isfinite(expected).all()
    assert torch.equal(quant_gemv(kernels, x, raw, ggml_type, bias, is_int8=True), expected)


@pytest.mark.parametrize("build", sorted(NARROWER_BUILDS))
def test_narrower_builds_give_the_native_builds_bits(kernels, build):
    """The AVX512-VNNI code (where this CPU has it), the AVX2 code (vpmaddubsw) and the generic code of
    the narrower builds."""
    narrow = load_cpu_kernels(extra_flags=NARROWER_BUILDS[build])
    assert narrow is not None and narrow.int8_kernel_kind() == (1 if build == "avx2" else 0)
    for ggml_type in TYPES:
        num_in = WIDTHS[ggml_type]
        raw = random_blocks(ggml_type, 37, num_in, seed=ggml_type)  # extreme fp16 scales included
        x = torch.randn(19, num_in, generator=torch.Generator().manual_seed(7))
        native = quant_gemv(kernels, x, raw, ggml_type, None, is_int8=True)
        assert torch.equal(quant_gemv(narrow, x, raw, ggml_type, None, is_int8=True), native, ), ggml_type


@pytest.mark.parametrize("ggml_type", TYPES)
def test_each_row_is_the_same_bits_at_every_row_count_and_thread_count(kernels, ggml_type):
    num_in = WIDTHS[ggml_type]
    raw = plain_blocks(ggml_type, 300, num_in, seed=3)  # N * K past the one-thread size: threads split N
    x = torch.randn(max(ROWS), num_in, generator=torch.Generator().manual_seed(ggml_type))
    whole = quant_gemv(kernels, x, raw, ggml_type, None, is_int8=True)
    for rows in ROWS:
        for start in (0, max(ROWS) - rows):
            part = quant_gemv(kernels, x[start : start + rows], raw, ggml_type, None, is_int8=True)
            assert torch.equal(part, whole[start : start + rows]), (rows, start)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = quant_gemv(kernels, x, raw, ggml_type, None, is_int8=True)
    finally:
        torch.set_num_threads(before)
    assert before >= 2 and torch.equal(single, whole)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_numbers_are_near_exact_modes(kernels, ggml_type):
    """Activations rounded to 8 bits a block: near, not equal to, the fp32 activations' product."""
    num_in = WIDTHS[ggml_type]
    raw = plain_blocks(ggml_type, 64, num_in, seed=5)
    x = torch.randn(8, num_in, generator=torch.Generator().manual_seed(5))
    exact = quant_gemv(kernels, x, raw, ggml_type, None)
    integer = quant_gemv(kernels, x, raw, ggml_type, None, is_int8=True)
    relative = (integer - exact).norm() / exact.norm()
    assert 0 < relative < 0.02, relative


def test_a_product_of_runs_of_two_types_is_each_runs_product(kernels):
    """Q4_K_M's fused q/k/v: Q4_K rows then Q6_K rows (QUANT_PARTS), each run as its own product."""
    num_in = 512
    first, second = plain_blocks(12, 24, num_in, seed=1), plain_blocks(14, 8, num_in, seed=2)
    layer = QuantLinear(num_in, 32, ((24, 12), (8, 14)), torch.nn.Parameter(torch.randn(32)))
    layer.weight.data.copy_(torch.cat([first.flatten(), second.flatten()]))
    assert layer.ggml_type == QUANT_PARTS
    x = torch.randn(5, num_in)
    fused = quant_gemv(kernels, x, layer.weight, QUANT_PARTS, layer.bias, is_int8=True)
    expected = torch.cat([quant_gemv(kernels, x, first, 12, layer.bias[:24], is_int8=True),
                          quant_gemv(kernels, x, second, 14, layer.bias[24:], is_int8=True)], dim=1)
    assert torch.equal(fused, expected)


def test_a_width_of_no_whole_blocks_is_refused(kernels):
    with pytest.raises(ValueError, match="no product for ggml type"):
        quant_gemv(kernels, torch.randn(1, 100), torch.zeros(4, 100, dtype=torch.uint8), 99, None, is_int8=True)


@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m"])
def test_narrower_builds_give_the_native_bits_on_trained_tensors(kernels, name):
    """A trained file's blocks (Gemma 3's Q8_0, Q4_K and Q6_K; SmolLM2's Q8_0 and Q4_1), 512 rows of each
    type's first tensor: the AVX2 and generic builds' integer products equal the native build's."""
    import sys

    import numpy as np
    from conftest import ROOT
    from gguf import GGUFReader

    sys.path.insert(0, str(ROOT / "scripts"))
    from real_models import path_of

    narrow = {build: load_cpu_kernels(extra_flags=NARROWER_BUILDS[build]) for build in ("avx2", "generic")}
    seen = set()
    for tensor in GGUFReader(str(path_of(name))).tensors:
        ggml_type = int(tensor.tensor_type)
        if ggml_type not in QUANT_TYPES or ggml_type in seen or len(tensor.shape) != 2:
            continue
        seen.add(ggml_type)
        num_in, num_out = int(tensor.shape[0]), int(tensor.shape[1])
        raw = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(num_out, -1)[:512].copy())
        x = torch.randn(5, num_in, generator=torch.Generator().manual_seed(0))
        native = quant_gemv(kernels, x, raw, ggml_type, None, is_int8=True)
        for build, built in narrow.items():
            assert torch.equal(quant_gemv(built, x, raw, ggml_type, None, is_int8=True), native), (build, tensor.name)
    assert len(seen) >= 2
