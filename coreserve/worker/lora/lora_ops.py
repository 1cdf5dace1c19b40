"""The model's ops with LoRA deltas (engine-core process, each tensor-parallel rank): the backend's ops,
and for each product a loaded adapter targets, each adapter's rows through its A then its B, times its
scale, added to those rows' base output (grouped low-rank products).

A step tells it which adapter each row belongs to (`set_rows`, by the model runner before the forward
and before each lm_head product: a row a token, then a row a logits row; `set_slot` for rows that are all
one request's). Where the backend hands it grouped products (`GroupedProducts`: the CPU's one C call a
product for every adapter, coreserve/worker/cpu/grouped_lora.py) they add the deltas; elsewhere torch's
products run an adapter's rows at a time. Batch invariance holds as for the base products: a row's delta
is a function of that row's values and its adapter alone, added to its base output by one addition, so a
row's bits do not depend on which adapters, or none, share its batch. The deltas are computed in fp32
whatever the weights' dtype (kept-quantized GGUF blocks included), as PEFT's unmerged forward computes them.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from coreserve.worker.lora.adapter import LoraAdapter
from coreserve.worker.models.ops import ModelOps


class GroupedProducts(Protocol):
    """A backend's deltas of every adapter of the step in one call a product (the Backend's `lora_products`)."""

    # the step's adapters (the groups, their slots ascending) and each row's group, rows [T] int32 (-1:
    # none; None: every row group 0), for the products that follow
    def select(self, adapters: list[LoraAdapter], rows: torch.Tensor | None) -> None: ...

    # adds the groups' deltas of `layer` to out [T, out] (x [T, in]); False: not taken (not its dtypes)
    def add(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> bool: ...


class LoraOps:
    """Wraps `base` (any ModelOps); every op but `embed` and `linear` is the base's."""

    def __init__(self, base: ModelOps, lm_head: nn.Module | None, grouped: GroupedProducts | None = None) -> None:
        self.base = base
        self.grouped = grouped  # the backend's one call a product; None: torch's products
        self.lm_head = lm_head  # the model's, which an adapter's modules_to_save copy replaces
        self.adapters: dict[int, LoraAdapter] = {}  # by slot: the loaded adapters
        self._present: list[LoraAdapter] = []  # the groups: this step's adapters, their slots ascending
        self._indices: list[torch.Tensor | None] = []  # each group's rows (None: every row)

    def add(self, slot: int, adapter: LoraAdapter) -> None:
        self.adapters[slot] = adapter

    def remove(self, slot: int) -> None:
        self.adapters.pop(slot, None)

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    @property
    def sum_over_ranks(self):
        return self.base.sum_over_ranks

    def set_rows(self, slots: torch.Tensor | None) -> None:
        """Each row's adapter slot (-1: none) for the products that follow; None: no row has one."""
        present = [] if slots is None else sorted(set(slots.tolist()) - {-1})
        rows = None  # [rows] int32 each row's group (-1: none)
        if present:
            group_of_slot = {slot: g for g, slot in enumerate(present)}
            rows = torch.tensor([group_of_slot.get(s, -1) for s in slots.tolist()], dtype=torch.int32)
        self._select(present, rows, [] if rows is None else [(rows == g).nonzero().squeeze(1) for g in range(len(present))])

    def set_slot(self, slot: int) -> None:
        """Every row of the products that follow runs with the adapter in `slot` (-1: none): one
        request's rows (its prompt logprobs' lm_head slices)."""
        self._select([] if slot < 0 else [slot], None, [None] if slot >= 0 else [])

    def _select(self, slots: list[int], rows: torch.Tensor | None, indices: list[torch.Tensor | None]) -> None:
        self._present, self._indices = [self.adapters[s] for s in slots], indices
        if self.grouped is not None:
            self.grouped.select(self._present, rows)

    def embed(self, table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.base.embed(table, input_ids)
        for adapter, index in zip(self._present, self._indices):
            ids = input_ids if index is None else input_ids[index]
            rows = x if index is None else x[index]
            if adapter.embed_tokens is not None:  # modules_to_save: the adapter's own table
                rows = adapter.embed_tokens[ids].to(x.dtype)
            if adapter.embed_a is not None:
                delta = self.base.linear(adapter.embed_b, adapter.embed_a[ids]).float() * adapter.embed_scale
                rows = (rows.float() + delta).to(x.dtype)
            _put(x, index, rows)
        return x

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = self.base.linear(layer, x)
        if not self._present:
            return out
        if layer is self.lm_head:  # modules_to_save: an adapter's own lm_head for its rows, first
            for adapter, index in zip(self._present, self._indices):
                if adapter.lm_head is not None:
                    rows = (x if index is None else x[index]).float()
                    _put(out, index, self.base.linear(adapter.lm_head, rows).to(out.dtype))
        if self.grouped is not None and self.grouped.add(layer, x, out):
            return out
        for adapter, index in zip(self._present, self._indices):
            parts = adapter.deltas.get(layer)
            if not parts:
                continue
            rows = (x if index is None else x[index]).float()
            base = (out if index is None else out[index]).float()
            for part in parts:  # in the adapter's order of targets, fixed for the adapter
                delta = self.base.linear(part.b, self.base.linear(part.a, rows).float()).float() * part.scale
                columns = slice(part.start, part.start + delta.shape[1])
                base[:, columns] = base[:, columns] + delta
            _put(out, index, base.to(out.dtype))
        return out


def _put(out: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> None:
    if index is None:
        if rows.data_ptr() != out.data_ptr():
            out.copy_(rows)
    else:
        out[index] = rows
