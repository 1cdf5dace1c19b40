"""Qwen3-Next's Gated DeltaNet projections as its checkpoints hold them, put in the order the model's one
in_proj reads (engine-core process, at load).

HF's Qwen3-Next fuses q, k, v and z into `in_proj_qkvz` and b, a into `in_proj_ba`, a key head's group at a
time: [q_g k_g v_g z_g] for each key head g (v_g and z_g: the value heads that key head serves), and
[b_g a_g] likewise. The model's in_proj holds each part whole ([q k v | z | b | a], Qwen3.5's order), so
the rows move once, whole (a GGUF tensor's quantized rows move as they are); llama.cpp's converter puts
q/k/v/z back itself, and keeps `ssm_ba` grouped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coreserve.worker.models.config import LinearAttentionArgs


@dataclass(frozen=True)
class GroupedRows:
    """Rows in `num_groups` groups of parts of `part_rows` each -> every group's part 0, then part 1, ..."""

    num_groups: int
    part_rows: tuple[int, ...]  # a part's rows in one group

    def undo(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """`rows` [num_groups * sum(part_rows), ...] (values or a quantized tensor's bytes) -> new memory
        in part-major order."""
        group_rows = sum(self.part_rows)
        if rows.dim() == 0 or rows.shape[0] != self.num_groups * group_rows:
            raise ValueError(f"{name}: shape {list(rows.shape)} does not hold {self.num_groups} key head groups "
                             f"of {group_rows} rows")
        groups = rows.reshape(self.num_groups, group_rows, *rows.shape[1:])
        return torch.cat([part.reshape(-1, *rows.shape[1:]) for part in groups.split(self.part_rows, dim=1)])


def grouped_rows(lin: LinearAttentionArgs | None, hf_name: str) -> GroupedRows | None:
    """The grouping of a Qwen3-Next checkpoint tensor (`...linear_attn.in_proj_qkvz.weight`, `in_proj_ba`);
    None for every other tensor."""
    if lin is None or not hf_name.endswith((".in_proj_qkvz.weight", ".in_proj_ba.weight")):
        return None
    per_key = lin.num_value_heads // lin.num_key_heads  # value heads a key head serves
    if hf_name.endswith(".in_proj_ba.weight"):
        return GroupedRows(lin.num_key_heads, (per_key, per_key))
    values = per_key * lin.value_head_dim
    return GroupedRows(lin.num_key_heads, (lin.key_head_dim, lin.key_head_dim, values, values))
