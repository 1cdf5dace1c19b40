"""transformers 5's fused expert tensors (gpt-oss's checkpoints) split into the model's experts at load
(engine-core process).

A gpt-oss layer keeps its experts in four tensors: `mlp.experts.gate_up_proj` [E, hidden, 2 I] with gate
and up interleaved in the last axis (gate the even columns, up the odd ones), `gate_up_proj_bias` [E, 2 I],
`down_proj` [E, I, hidden] and `down_proj_bias` [E, hidden], each product x @ W (HF's layout, the transpose
of nn.Linear's). Each expert of coreserve/worker/models/moe.py is two nn.Linear layers, gate_up_proj's rows
[gate | up] in halves (the ops' layout): read whole, every size checked, each expert's part transposed into
its place. A checkpoint with MXFP4 experts holds `gate_up_proj_blocks`, `_scales` and `down_proj`'s in place of
the two float weights (coreserve/worker/models/mxfp4_experts.py reads them).
"""

from __future__ import annotations

import torch

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.mxfp4_experts import MXFP4_PARTS

_PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_BIASES = ("gate_up_proj_bias", "down_proj_bias")


def fused_expert_part(args: DecoderArgs, hf_name: str) -> tuple[int, str] | None:
    """(layer, part) of `model.layers.L.mlp.experts.<part>` in a model whose experts are fused in its
    checkpoint (gpt-oss's: float weights, or MXFP4 ones where its config says so); None: not such a tensor."""
    if args.moe is None or args.moe.clamped_swiglu is None:
        return None
    parts = hf_name.split(".")
    if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"]:
        return None
    served = (*_BIASES, *MXFP4_PARTS) if args.moe.is_mxfp4 else _PARTS
    if parts[5] not in served or not parts[2].isdigit() or int(parts[2]) >= args.num_layers:
        return None
    return int(parts[2]), parts[5]


def fused_shape(args: DecoderArgs, part: str) -> tuple[int, ...]:
    """The shape the config gives a fused part."""
    assert args.moe is not None
    experts, hidden, width = args.moe.num_experts, args.hidden_size, args.moe.intermediate_size
    return {
        "gate_up_proj": (experts, hidden, 2 * width), "gate_up_proj_bias": (experts, 2 * width),
        "down_proj": (experts, width, hidden), "down_proj_bias": (experts, hidden),
    }[part]


def check_fused_part(
    args: DecoderArgs, layer: int, part: str, shape: tuple[int, ...], dtype: torch.dtype, where: str
) -> None:
    """A fused part's shape (as its file's header states it, before a byte is read) and dtype: the config's
    shape, floating point."""
    name, expected = f"model.layers.{layer}.mlp.experts.{part}", fused_shape(args, part)
    if tuple(shape) != expected:
        raise ValueError(f"{where}: tensor {name} has shape {list(shape)}; this model's config makes it {list(expected)}")
    if not dtype.is_floating_point:
        raise ValueError(f"{where}: tensor {name} has dtype {dtype}, not a floating-point type as a weight's must be")


def split_fused_experts(
    params: dict[str, torch.Tensor], args: DecoderArgs, layer: int, part: str, tensor: torch.Tensor, where: str
) -> dict[str, int]:
    """Copies a fused part (checked first) into each expert's parameter. Returns each parameter written and
    its elements."""
    check_fused_part(args, layer, part, tuple(tensor.shape), tensor.dtype, where)
    expected = fused_shape(args, part)
    module = "gate_up_proj" if part.startswith("gate_up") else "down_proj"
    kind = "bias" if part.endswith("_bias") else "weight"
    filled = {}
    for expert in range(expected[0]):
        name = f"layers.{layer}.moe.experts.{expert}.{module}.{kind}"
        if name not in params:
            raise ValueError(f"{where}: weight model.layers.{layer}.mlp.experts.{part} does not belong to this "
                             "model's config")
        values = tensor[expert]  # [hidden, 2 I], [2 I], [I, hidden] or [hidden]
        if kind == "weight":
            values = values.t()  # nn.Linear's [out, in]
        if module == "gate_up_proj":  # interleaved -> [gate | up]
            values = torch.cat((values[0::2], values[1::2]))
        params[name].data.copy_(values)
        filled[name] = values.numel()
    return filled
