"""Weights with a NaN or an infinity are refused where they enter the model (engine-core process): at
load, in update_weights and wake_up's checkpoints (llama.cpp's --check-tensors, always on here: its cost
is in docs/serving.md, "Untrusted files").

A float tensor is scanned in chunks (no copy of the whole tensor); a weight kept in GGUF blocks has its
values as block scales times small integers, so its scales (the fp16 `d` and `dmin` of each block) are
what can be non-finite, and only they are read. An MXFP4 block's scale is a power of two 2^(e - 128)
(always finite: e = 255, e8m0's NaN, is 2^127 to ggml, gguf and transformers alike, and so here), but
its values overflow fp32 from e = 253 on where a nibble is large enough: those blocks are refused, exactly
the ones whose dequantized values hold an infinity.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from coreserve.worker.models.quantized import MXFP4, QUANT_TYPES, row_runs

# ggml type -> byte offsets of the fp16 scales in one block (llama.cpp's block_q8_0, block_q4_K, ...)
_SCALE_OFFSETS = {8: (0,), 2: (0,), 3: (0, 2), 12: (0, 2), 13: (0, 2), 14: (208,)}
_CHUNK = 1 << 22  # elements scanned at once
_FP16_EXPONENT, _BF16_EXPONENT = 0x7C00, 0x7F80
_FP16_PAIR_LOW, _FP16_PAIR_HIGH = np.uint32(0x7C00), np.uint32(0x7C00 << 16)  # two fp16s in a little-endian word
_MXFP4_MAGNITUDES = (0, 1, 2, 3, 4, 6, 8, 12)  # |value| * 2 by a nibble's low 3 bits
_MXFP4_SAFE_SCALE = 252  # the largest e whose every value is finite: 12 * 2^(252 - 128) < 2^128


def check_finite_model(model: nn.Module, where: str) -> None:
    """A ValueError naming the first parameter or buffer holding a NaN or an infinity."""
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if not is_finite(tensor):
            raise ValueError(f"{where}: weight {name} holds NaN or infinite values")


def check_finite_tensor(tensor: torch.Tensor, name: str, where: str) -> None:
    if not is_finite(tensor):
        raise ValueError(f"{where}: tensor {name} holds NaN or infinite values")


def is_finite(tensor: torch.Tensor) -> bool:
    if tensor.dtype.is_floating_point:
        flat = tensor.detach().reshape(-1)
        if flat.device.type == "cpu":  # numpy: one thread, no per-call overhead to share with the others
            return all(_floats_are_finite(flat[i : i + _CHUNK]) for i in range(0, flat.numel(), _CHUNK))
        return all(bool(torch.isfinite(flat[i : i + _CHUNK]).all()) for i in range(0, flat.numel(), _CHUNK))
    if getattr(tensor, "ggml_type", 0):
        return all(_mxfp4_is_finite(run) if ggml_type == MXFP4 else _scales_are_finite(run, ggml_type)
                   for ggml_type, run in row_runs(tensor))
    return True  # integers: every value is a number


def _floats_are_finite(chunk: torch.Tensor) -> bool:
    if chunk.dtype == torch.bfloat16:  # numpy has no bf16: its exponent bits, as the scales' below
        bits = chunk.view(torch.int16).numpy().view(np.uint16)
        return not ((bits & _BF16_EXPONENT) == _BF16_EXPONENT).any()
    return bool(np.isfinite(chunk.numpy()).all())


def _scales_are_finite(run: torch.Tensor, ggml_type: int) -> bool:
    """run: [rows, row bytes] uint8 of one ggml type. An fp16 is NaN or infinite when its five exponent
    bits are all set: tested on the scales' bits where they lie, both scales of a block in one 32-bit
    word where the block is whole words (one pass over the blocks: the pass is memory-bound)."""
    if run.device.type != "cpu":  # the exponent bits tested where the blocks lie: no copy to the host
        words = run.detach().reshape(-1).view(torch.int16).view(-1, QUANT_TYPES[ggml_type][1] // 2)
        return not any(bool(((words[:, o // 2] & 0x7C00) == 0x7C00).any()) for o in _SCALE_OFFSETS[ggml_type])
    raw = run.detach().reshape(-1).numpy()
    block_bytes, offsets = QUANT_TYPES[ggml_type][1], _SCALE_OFFSETS[ggml_type]
    if len(offsets) == 2 and block_bytes % 4 == 0:
        pairs = raw.view(np.uint32).reshape(-1, block_bytes // 4)[:, offsets[0] // 4]
        return not (((pairs & _FP16_PAIR_LOW) == _FP16_PAIR_LOW) | ((pairs & _FP16_PAIR_HIGH) == _FP16_PAIR_HIGH)).any()
    words = raw.view(np.uint16).reshape(-1, block_bytes // 2)
    return not any(((words[:, offset // 2] & _FP16_EXPONENT) == _FP16_EXPONENT).any() for offset in offsets)


def _mxfp4_is_finite(run: torch.Tensor) -> bool:
    """run: [rows, row bytes] uint8 of MXFP4 blocks. A value |v| / 2 * 2^(e - 127) overflows fp32 where it
    reaches 2^128, i.e. where |v| >= 2^(256 - e) (|v| the doubled magnitude, at most 12): only blocks of
    e > 252 can, and only they (few, where any) have their nibbles read."""
    blocks = run.detach().reshape(-1, QUANT_TYPES[MXFP4][1])
    suspects = blocks[blocks[:, 0] > _MXFP4_SAFE_SCALE].cpu()
    if suspects.shape[0] == 0:
        return True
    nibbles = torch.cat([suspects[:, 1:] & 7, suspects[:, 1:] >> 4 & 7], dim=1).int()
    largest = torch.tensor(_MXFP4_MAGNITUDES, dtype=torch.int32)[nibbles].amax(dim=1)
    return not bool((largest >= 2 ** (256 - suspects[:, 0].int())).any())
