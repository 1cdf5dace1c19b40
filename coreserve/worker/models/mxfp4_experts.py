"""gpt-oss's MXFP4 experts as the hub's checkpoints hold them (quantization_config's quant_method "mxfp4"),
read into the model's experts at load (engine-core process).

A layer's experts are two pairs of tensors: `mlp.experts.gate_up_proj_blocks` [E, 2 I, hidden / 32, 16] uint8
with its `_scales` [E, 2 I, hidden / 32] uint8, and `down_proj_blocks` [E, hidden, I / 32, 16] with its
`_scales` [E, hidden, I / 32] (transformers' layout: rows are outputs, nn.Linear's order, gate_up's gate and up
interleaved as in the float checkpoint; each 32 values of a row are 16 bytes, element 2j in byte j's low
nibble and 2j + 1 in its high one, times 2^(scale - 127)). Each pair is repacked into ggml's MXFP4 blocks
(a scale byte, then byte j holding element j low and j + 16 high: coreserve/worker/models/quantized.py's type
39, the C products' one layout): the same values, bits only moved. Under dtype "auto" the experts stay in
those blocks (QuantLinear); under a float dtype they are those blocks' values (quantized.py's `dequantize`:
gguf's routine), the numbers transformers dequantizes to. gate_up's rows go to [gate | up] halves whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from coreserve.worker.models import safetensors_files
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.quantized import MXFP4, dequantize

MXFP4_PARTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
_MODULES = ("gate_up_proj", "down_proj")


def mxfp4_plan(args: DecoderArgs) -> dict[str, int]:
    """Every expert's two linear layers -> MXFP4: what quantize_modules keeps in blocks under dtype "auto"."""
    assert args.moe is not None and args.moe.is_mxfp4
    return {f"layers.{layer}.moe.experts.{expert}.{module}": MXFP4
            for layer in range(args.num_layers) if args.moe.is_sparse(layer)
            for expert in range(args.moe.num_experts) for module in _MODULES}


def checkpoint_values(name: str, shape: tuple[int, ...]) -> int:
    """The weights a checkpoint tensor holds: an MXFP4 `_blocks` tensor two a byte (the file's size check)."""
    return math.prod(shape) * (2 if name.endswith(("gate_up_proj_blocks", "down_proj_blocks")) else 1)


def mxfp4_shape(args: DecoderArgs, part: str) -> tuple[int, ...]:
    """The shape the config gives a part (MXFP4_PARTS)."""
    assert args.moe is not None
    experts, hidden, width = args.moe.num_experts, args.hidden_size, args.moe.intermediate_size
    rows, columns = (2 * width, hidden) if part.startswith("gate_up") else (hidden, width)
    return (experts, rows, columns // 32, 16) if part.endswith("_blocks") else (experts, rows, columns // 32)


def check_mxfp4_part(args: DecoderArgs, layer: int, part: str, entry: safetensors_files.TensorEntry,
                     where: str) -> None:
    """A part's shape (as the header states it, before a byte is read) and dtype: the config's, uint8."""
    name, expected = f"model.layers.{layer}.mlp.experts.{part}", mxfp4_shape(args, part)
    if tuple(entry.shape) != expected:
        raise ValueError(f"{where}: tensor {name} has shape {list(entry.shape)}; this model's config makes it "
                         f"{list(expected)}")
    if entry.dtype != torch.uint8:
        raise ValueError(f"{where}: tensor {name} has dtype {entry.dtype}; MXFP4 {part.rsplit('_', 1)[1]} are uint8")


def repack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [R, G, 16] and scales [R, G] uint8 (transformers') -> [R, G * 17] uint8, ggml's MXFP4 blocks."""
    elements = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:2], 32)
    nibbles = elements[..., :16] | elements[..., 16:] << 4
    return torch.cat((scales.unsqueeze(-1), nibbles), dim=-1).reshape(blocks.shape[0], -1)


def load_mxfp4_part(
    params: dict[str, torch.Tensor], args: DecoderArgs, layer: int, part: str,
    entry: safetensors_files.TensorEntry, entries: Mapping[str, safetensors_files.TensorEntry], where: str,
) -> dict[str, int]:
    """A layer's `part` (`entry`: its blocks, read with their scales, found in `entries` by name; the scales
    alone are checked and left to their blocks) into each expert's layer. Returns each parameter written and
    its elements."""
    prefix = f"model.layers.{layer}.mlp.experts."
    check_mxfp4_part(args, layer, part, entry, where)
    if part.endswith("_scales"):
        return {}
    module = part.removesuffix("_blocks")
    scales_entry = entries.get(f"{prefix}{module}_scales")
    if scales_entry is None:
        raise ValueError(f"{where}: tensor {prefix}{part} has no {prefix}{module}_scales beside it")
    check_mxfp4_part(args, layer, f"{module}_scales", scales_entry, where)
    blocks = safetensors_files.read_tensor(entry)
    scales = safetensors_files.read_tensor(scales_entry)
    filled = {}
    for expert in range(blocks.shape[0]):
        name = f"layers.{layer}.moe.experts.{expert}.{module}.weight"
        if name not in params:
            raise ValueError(f"{where}: weight {prefix}{part} does not belong to this model's config")
        raw = repack(blocks[expert], scales[expert])  # [rows, row bytes]
        if module == "gate_up_proj":  # interleaved rows -> [gate | up]: whole rows, their bytes
            raw = torch.cat((raw[0::2], raw[1::2]))
        param = params[name]
        param.data.copy_(raw if param.dtype == torch.uint8 else dequantize(raw, MXFP4))
        filled[name] = param.numel()
    return filled
