"""The model's ops with LoRA deltas (engine-core process): the backend's ops, and for each product a
loaded adapter targets, each adapter's rows through its A then its B (grouped low-rank products), times
its scale, added to those rows' base output.

A step tells it which adapter each row belongs to (`rows`, set by the model runner before the forward
and before each lm_head product: a row a token, then a row a logits row). Batch invariance holds as for
the base products: a row's delta is the backend's linear on that row's values alone (gemv.c on the CPU,
one order of summation per output whatever the rows), the adapters' groups are taken in a fixed order
(their slots ascending) and each row receives its one adapter's delta by one addition, so a row's bits do
not depend on which adapters, or none, share its batch. The deltas are computed in fp32 whatever the
weights' dtype (kept-quantized GGUF blocks included), as PEFT's unmerged forward computes them.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.lora.adapter import LoraAdapter
from worker.models.ops import ModelOps


class LoraOps:
    """Wraps `base` (any ModelOps); every op but `embed` and `linear` is the base's."""

    def __init__(self, base: ModelOps, adapters: dict[int, LoraAdapter], lm_head: nn.Module) -> None:
        self.base = base
        self.lm_head = lm_head  # the model's, which an adapter's modules_to_save copy replaces
        self.adapters = adapters  # by slot: the model runner's loaded adapters
        self.rows: torch.Tensor | None = None  # [rows] int64 slot of each row's adapter; -1: none
        # (adapter, its rows' indices) in slot order; indices None: every row (set_slot)
        self._groups: list[tuple[LoraAdapter, torch.Tensor | None]] = []

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    @property
    def sum_over_ranks(self):
        return self.base.sum_over_ranks

    def set_rows(self, rows: torch.Tensor | None) -> None:
        """Each row's adapter slot (-1: none) for the products that follow; None: no row has one."""
        self.rows, self._groups = rows, []
        if rows is None:
            return
        for slot in sorted(set(rows.tolist()) - {-1}):
            self._groups.append((self.adapters[slot], (rows == slot).nonzero().squeeze(1)))

    def set_slot(self, slot: int) -> None:
        """Every row of the products that follow runs with the adapter in `slot` (-1: none): one
        request's rows (its prompt logprobs' lm_head slices)."""
        self.rows, self._groups = None, []
        if slot >= 0:
            self._groups.append((self.adapters[slot], None))

    def embed(self, table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.base.embed(table, input_ids)
        for adapter, index in self._groups:
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
        for adapter, index in self._groups:
            assert index is None or x.shape[0] == self.rows.shape[0], "LoRA rows not set for this product"
            parts = adapter.deltas.get(layer)
            is_own_head = adapter.lm_head is not None and layer is self.lm_head
            if not parts and not is_own_head:
                continue
            rows = (x if index is None else x[index]).float()
            if is_own_head:  # modules_to_save: the adapter's own lm_head
                _put(out, index, self.base.linear(adapter.lm_head, rows).to(out.dtype))
            if not parts:
                continue
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
