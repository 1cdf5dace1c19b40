"""The model's ops with LoRA deltas (engine-core process): the backend's ops, and for each product a
loaded adapter targets, each adapter's rows through its A then its B, times its scale, added to those
rows' base output (grouped low-rank products).

A step tells it which adapter each row belongs to (`set_rows`, by the model runner before the forward
and before each lm_head product: a row a token, then a row a logits row; `set_slot` for rows that are all
one request's). On the CPU kernels one call a product adds every adapter's deltas
(csrc/lora_rows.c: each row's dot products in one fixed order); elsewhere torch's products run an
adapter's rows at a time. Batch invariance holds as for the base products: a row's delta is a function
of that row's values and its adapter alone, added to its base output by one addition, so a row's bits do
not depend on which adapters, or none, share its batch. The deltas are computed in fp32 whatever the
weights' dtype (kept-quantized GGUF blocks included), as PEFT's unmerged forward computes them.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from coreserve.worker.cpu.bindings import LoraGroup, LoraPart
from coreserve.worker.cpu.fused_decode import FusedLora
from coreserve.worker.lora.adapter import LoraAdapter
from coreserve.worker.models.ops import ModelOps


class LoraOps:
    """Wraps `base` (any ModelOps); every op but `embed` and `linear` is the base's."""

    def __init__(self, base: ModelOps, adapters: dict[int, LoraAdapter], lm_head: nn.Module) -> None:
        self.base = base
        self.kernels = getattr(base, "kernels", None)  # the CPU backend's: one C call a product
        self.lm_head = lm_head  # the model's, which an adapter's modules_to_save copy replaces
        self.adapters = adapters  # by slot: the model runner's loaded adapters
        self.rows: torch.Tensor | None = None  # [rows] int32 each row's group (-1: none); None: all group 0
        self._present: list[LoraAdapter] = []  # the groups: this step's adapters, their slots ascending
        self._indices: list[torch.Tensor | None] = []  # each group's rows (None: every row)
        self._arrays: dict = {}  # the groups' LoraGroup array by product, and fused_lora's, for these groups

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    @property
    def sum_over_ranks(self):
        return self.base.sum_over_ranks

    def set_rows(self, slots: torch.Tensor | None) -> None:
        """Each row's adapter slot (-1: none) for the products that follow; None: no row has one."""
        present = [] if slots is None else sorted(set(slots.tolist()) - {-1})
        self._set_present(present)
        if slots is None or not present:
            self.rows, self._indices = None, []
            return
        group_of_slot = {slot: g for g, slot in enumerate(present)}
        self.rows = torch.tensor([group_of_slot.get(s, -1) for s in slots.tolist()], dtype=torch.int32)
        self._indices = [(self.rows == g).nonzero().squeeze(1) for g in range(len(present))]

    def set_slot(self, slot: int) -> None:
        """Every row of the products that follow runs with the adapter in `slot` (-1: none): one
        request's rows (its prompt logprobs' lm_head slices)."""
        self._set_present([] if slot < 0 else [slot])
        self.rows, self._indices = None, [None] if slot >= 0 else []

    def _set_present(self, slots: list[int]) -> None:
        present = [self.adapters[s] for s in slots]
        if [id(a) for a in present] != [id(a) for a in self._present]:
            self._present, self._arrays = present, {}

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
        if self.kernels is not None and out.dtype == torch.float32 and x.dtype == torch.float32:
            self._add_in_c(layer, x, out)
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

    def fused_lora(self, model: nn.Module) -> FusedLora | None:
        """This step's adapters as the fused decode forward reads them (csrc/decode_forward.c: each layer's
        four products and lm_head), or None where it cannot take them: an adapter with an embedding LoRA or
        its own table or lm_head (modules_to_save). (An adapter's ranks were bounded when it was read.)"""
        if self.rows is None or any(a.embed_a is not None or a.embed_tokens is not None or a.lm_head is not None
                                    for a in self._present):
            return None
        key = ("fused", id(model))
        if key not in self._arrays:
            modules = [m for layer in model.layers
                       for m in (layer.qkv_proj, layer.o_proj, getattr(layer, "gate_up_proj", None),
                                 getattr(layer, "down_proj", None))] + [model.lm_head]
            arrays = [None if m is None else self._group_array(m) for m in modules]
            self._arrays[key] = (
                (ctypes.c_void_p * len(arrays))(*[0 if a is None else ctypes.addressof(a) for a in arrays]), arrays)
        fused = self._arrays[key]
        if fused is None:
            return None
        return FusedLora(self.rows, fused[0], len(self._present), fused[1])

    def _group_array(self, layer: nn.Module) -> ctypes.Array | None:
        """The present adapters' LoraGroup array for `layer`'s product (None: none of them targets it)."""
        if layer not in self._arrays:
            groups = [_c_group(adapter, layer) for adapter in self._present]
            self._arrays[layer] = (LoraGroup * len(groups))(*groups) if any(g.rank for g in groups) else None
        return self._arrays[layer]

    def _add_in_c(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        groups = self._group_array(layer)
        if groups is None:
            return
        x = x.contiguous()
        assert out.is_contiguous()
        rows = self.rows if self.rows is not None else torch.zeros(x.shape[0], dtype=torch.int32)
        assert rows.shape[0] == x.shape[0], "LoRA rows not set for this product"
        status = self.kernels.lora_rows(
            x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), out.shape[1], rows.data_ptr(),
            ctypes.addressof(groups), len(groups), torch.get_num_threads(),
        )
        if status != 0:  # the ranks were bounded when the adapter was read (adapter.py): memory alone
            raise MemoryError("LoRA's grouped products could not allocate their row lists")


_EMPTY = LoraGroup(None, 0, 0, None)



def _c_group(adapter: LoraAdapter, layer: nn.Module) -> LoraGroup:
    """The adapter's parts for `layer` as csrc/lora_rows.c reads them: its A rows concatenated, its Bs,
    made once per adapter and product (the tensors kept on the adapter)."""
    packed = adapter.packed.get(layer)
    if packed is None:
        parts = adapter.deltas.get(layer)
        if not parts:
            return _EMPTY
        a = torch.cat([p.a.weight for p in parts]).contiguous()
        bts = [p.b.weight.t().contiguous() for p in parts]  # [rank, width]
        offsets = [sum(p.a.weight.shape[0] for p in parts[:i]) for i in range(len(parts))]
        array = (LoraPart * len(parts))(*[
            LoraPart(p.start, bt.shape[1], offset, bt.shape[0], bt.data_ptr(), p.scale)
            for p, bt, offset in zip(parts, bts, offsets)
        ])
        packed = adapter.packed[layer] = (LoraGroup(a.data_ptr(), a.shape[0], len(parts), array), a, bts, array)
    return packed[0]


def _put(out: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> None:
    if index is None:
        if rows.data_ptr() != out.data_ptr():
            out.copy_(rows)
    else:
        out[index] = rows
