"""How a Llama-family model splits over the ranks of tensor parallelism (the rank processes).

Megatron's split: q/k/v and gate/up by output features (whole attention heads, whole MLP columns),
o_proj and down_proj by input features. Each rank then computes its heads' attention and its MLP
columns alone, and each layer half ends in one all-reduce (a sum) of the [T, hidden] partial outputs.
The embedding, the norms and lm_head are replicated: every rank holds the whole hidden state between
layer halves, and every rank computes the same logits.

The loader keeps each rank's part of a checkpoint tensor (`is_split`, `rank_part`); `apply_tp` then
makes the loaded model a rank's, from outside the model, as gpt-fast's does. A LoRA adapter's pairs split
as their modules' weights do (`rank_lora_pair`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Protocol

import torch
from torch import nn

from coreserve.worker.models.config import DecoderArgs

# HF tensor name (after `model.layers.N.`) -> the dimension it splits on.
_BY_OUTPUT = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "mlp.gate_proj.", "mlp.up_proj.")
_BY_INPUT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_ONCE = "self_attn.o_proj.bias"  # added after the sum: rank 0 holds it, the others hold zeros


class SumGroup(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...  # the sum over ranks, in place


def apply_tp(model: nn.Module, group: SumGroup) -> None:
    """A loaded rank's model (its heads and MLP columns) ends each layer half in the sum over the ranks:
    its ops' `sum_over_ranks` becomes the group's all-reduce."""
    model.ops = copy.copy(model.ops)
    model.ops.sum_over_ranks = group.all_reduce


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    size: int


def shard_args(args: DecoderArgs, size: int) -> DecoderArgs:
    """One rank's arguments: its share of the heads and MLP columns. A ValueError when they do not split."""
    counts = {
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "intermediate_size": args.intermediate_size,
    }
    if args.moe is not None:  # each expert splits as a dense MLP does; the router is whole on every rank
        counts["moe_intermediate_size"] = args.moe.intermediate_size
    uneven = [f"{name}={count}" for name, count in counts.items() if count % size]
    if uneven:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {', '.join(uneven)}")
    moe = args.moe and dataclasses.replace(args.moe, intermediate_size=args.moe.intermediate_size // size)
    return dataclasses.replace(
        args,
        moe=moe,
        num_heads=args.num_heads // size,
        num_kv_heads=args.num_kv_heads // size,
        intermediate_size=args.intermediate_size // size,
    )


def is_split(hf_name: str) -> bool:
    """Whether this rank holds a part of the tensor rather than all of it."""
    layer_part = _layer_part(hf_name)
    return layer_part is not None and (
        layer_part.startswith(_BY_OUTPUT) or layer_part in _BY_INPUT or layer_part == _ONCE
    )


def rank_part(hf_name: str, tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This rank's part of a checkpoint tensor for which is_split() holds."""
    layer_part = _layer_part(hf_name)
    assert layer_part is not None
    if layer_part == _ONCE:
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)
    dim = 1 if layer_part in _BY_INPUT else 0
    return tensor.chunk(shard.size, dim=dim)[shard.rank]


def rank_lora_pair(module_name: str, a: torch.Tensor, b: torch.Tensor, widths: tuple[int, ...],
                   shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a LoRA pair, A [r, in] and B [out, r], on the module `module_name` (PEFT's name
    without `.weight`, `model.layers.N.self_attn.q_proj`), split as the module's weight is: one split by
    output features (q/k/v, gate/up) keeps A whole and its rows of B, each of B's parts of `widths` (a fused
    qkv_proj's q, k and v) split alike; one split by input features (o_proj, down_proj) keeps its columns of
    A and B whole, so the layer's sum over the ranks adds B (A x) once; a whole module (lm_head) both whole."""
    layer_part = _layer_part(module_name + ".weight")
    if layer_part is None:
        return a, b
    if layer_part in _BY_INPUT:
        return a.chunk(shard.size, dim=1)[shard.rank], b
    return a, torch.cat([part.chunk(shard.size, dim=0)[shard.rank] for part in b.split(list(widths))])


# A mixture's expert tensors split as the dense MLP's of the same role
_EXPERT_ROLES = {"gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
                 "w1": "mlp.gate_proj", "w3": "mlp.up_proj", "w2": "mlp.down_proj"}


def _layer_part(hf_name: str) -> str | None:
    """The name after `model.layers.N.`; an expert's (`mlp.experts.E.up_proj.weight`, Mixtral's
    `block_sparse_moe.experts.E.w3.weight`) as its dense role's (`mlp.up_proj.weight`)."""
    parts = hf_name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None
    rest = parts[3:]
    if len(rest) == 5 and rest[1] == "experts" and rest[3] in _EXPERT_ROLES:
        return f"{_EXPERT_ROLES[rest[3]]}.{rest[4]}"
    return ".".join(rest)
