"""The CPU backend's plan of a step's attention rows (engine-core process): the decode rows' host
arrays with their addresses, looked up once a step rather than once a layer (numpy's lookup is slow),
and under batch invariance every token of the step as a decode row over its causal prefix. Made by
`CpuBackend.prepare` before the forward; the decode kernel and the fused forward only read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coreserve.worker.step.attention import AttentionMetadata, DecodeRows, every_token_rows, slots_of


@dataclass(frozen=True)
class KernelRows:
    """Decode rows as the C kernels read them."""

    rows: DecodeRows
    pointers: tuple[int, int, int]  # the addresses of rows.rows, rows.block_tables, rows.context_lens

    @classmethod
    def of(cls, rows: DecodeRows) -> KernelRows:
        return cls(rows, (rows.rows.ctypes.data, rows.block_tables.ctypes.data, rows.context_lens.ctypes.data))


@dataclass(frozen=True)
class CpuAttentionPlan:
    decode: KernelRows | None  # the step's decode rows; None: no row decodes
    every_token: KernelRows | None  # batch invariance: every token as a decode row; None: not invariant

    def next_step(self, decode: DecodeRows) -> CpuAttentionPlan:
        rows = KernelRows.of(decode)
        return CpuAttentionPlan(rows, rows if self.every_token is not None else None)

    def next_slots(self, positions: torch.Tensor) -> torch.Tensor:
        assert self.decode is not None
        tables = torch.from_numpy(self.decode.rows.block_tables)
        return slots_of(tables, positions, self.decode.rows.block_size)


def cpu_attention_plan(meta: AttentionMetadata, is_batch_invariant: bool, block_size: int) -> CpuAttentionPlan:
    """The plan of `meta`'s rows; every_token where the ops are batch invariant."""
    decode = None if meta.decode is None else KernelRows.of(meta.decode)
    if not is_batch_invariant:
        return CpuAttentionPlan(decode, None)
    every_token = every_token_rows(meta, block_size)  # the decode rows themselves in a decode-only step
    return CpuAttentionPlan(decode, decode if every_token is meta.decode else KernelRows.of(every_token))
