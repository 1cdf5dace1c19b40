"""The LoRA adapters' deltas on the C kernels (engine-core process, each tensor-parallel rank): the CPU
backend's grouped products (coreserve/worker/lora/lora_ops.py's `GroupedProducts`), which `LoraOps` is
handed and tells each step's adapters and rows.

One call a product adds every adapter's deltas (csrc/lora_rows.c): for each row, h = A x over the ranks
of all the adapter's parts of that product (their A rows concatenated), then each part's B on h, times
its scale, into its columns, every dot product in one written order, so a row's delta is a function of
its values and its adapter alone. The fused decode forward (csrc/decode_forward.c) takes the same arrays
(`fused`). An adapter's parts are packed once per product and kept on the adapter (`LoraAdapter.packed`).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import nn

from coreserve.worker.cpu.bindings import CpuKernels, LoraGroup, LoraPart
from coreserve.worker.cpu.fused_decode import FusedLora

if TYPE_CHECKING:  # the type only: the adapters are LoRA's, handed in
    from coreserve.worker.lora.adapter import LoraAdapter

_EMPTY = LoraGroup(None, 0, 0, None)


class CpuGroupedLora:
    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self.adapters: list[LoraAdapter] = []  # the groups: the step's adapters, their slots ascending
        self.rows: torch.Tensor | None = None  # [rows] int32 each row's group (-1: none); None: all group 0
        self._arrays: dict = {}  # the groups' LoraGroup array by product, and the fused forward's, for these groups

    def select(self, adapters: list[LoraAdapter], rows: torch.Tensor | None) -> None:
        if [id(a) for a in adapters] != [id(a) for a in self.adapters]:
            self.adapters, self._arrays = list(adapters), {}
        self.rows = rows

    def add(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> bool:
        """The groups' deltas of `layer` added to out [T, out] in one C call; False where the activations
        are not fp32 (torch's products take them)."""
        if out.dtype != torch.float32 or x.dtype != torch.float32:
            return False
        groups = self._group_array(layer)
        if groups is None:
            return True
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
        return True

    def fused(self, model: nn.Module) -> FusedLora | None:
        """The step's adapters as the fused decode forward reads them (each layer's four products and
        lm_head), or None where it cannot take them: no rows set, or an adapter with an embedding LoRA or
        its own table or lm_head (modules_to_save). (An adapter's ranks were bounded when it was read.)"""
        if self.rows is None or any(a.embed_a is not None or a.embed_tokens is not None or a.lm_head is not None
                                    for a in self.adapters):
            return None
        key = ("fused", id(model))
        if key not in self._arrays:
            modules = [m for layer in model.layers
                       for m in (layer.qkv_proj, layer.o_proj, getattr(layer, "gate_up_proj", None),
                                 getattr(layer, "down_proj", None))] + [model.lm_head]
            arrays = [None if m is None else self._group_array(m) for m in modules]
            self._arrays[key] = (
                (ctypes.c_void_p * len(arrays))(*[0 if a is None else ctypes.addressof(a) for a in arrays]), arrays)
        products, arrays = self._arrays[key]
        return FusedLora(self.rows, products, len(self.adapters), arrays)

    def _group_array(self, layer: nn.Module) -> ctypes.Array | None:
        """The groups' LoraGroup array for `layer`'s product (None: none of them targets it)."""
        if layer not in self._arrays:
            groups = [_c_group(adapter, layer) for adapter in self.adapters]
            self._arrays[layer] = (LoraGroup * len(groups))(*groups) if any(g.rank for g in groups) else None
        return self._arrays[layer]


def _c_group(adapter: LoraAdapter, layer: nn.Module) -> LoraGroup:
    """The adapter's parts for `layer` as csrc/lora_rows.c reads them: its A rows concatenated, its Bs
    transposed, made once per adapter and product (the tensors kept on the adapter)."""
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
