"""A runner's LoRA adapters by slot (engine-core process, and each tensor-parallel rank): the runner's
part that reads an adapter into a slot when the core's `add_lora` verb asks (coreserve/worker/runner_control.py;
under tensor parallelism every rank reads the file and keeps its shard of each pair), drops it on
`remove_lora`, and tells the model's LoRA ops (lora_ops.py) which slot each row of a step runs with.

The core decides what is loaded and when (coreserve/engine_core/lora_table.py): a slot is one load of one
adapter, read between steps, never during one.
"""

from __future__ import annotations

import torch

from coreserve.worker.lora.adapter import read_adapter
from coreserve.worker.lora.lora_ops import GroupedProducts, LoraOps
from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.sharding import Shard


class AdapterSlots:
    """Wraps `model`'s ops in LoraOps (over the backend's grouped products, None: torch's)."""

    def __init__(self, model: DecoderModel, max_rank: int, shard: Shard | None, grouped: GroupedProducts | None) -> None:
        self.model = model
        self.max_rank = max_rank  # max_lora_rank: a higher rank is refused
        self.shard = shard  # this rank's part of a tensor-parallel model; None: the whole
        self.ops = LoraOps(model.ops, model.lm_head, grouped)
        model.ops = self.ops

    def add(self, slot: int, name: str, path: str) -> int:
        """Reads the PEFT adapter at `path` into `slot` (a ValueError names what does not fit); returns its
        size in bytes (this rank's shard)."""
        try:
            adapter = read_adapter(path, name, self.model, self.max_rank, self.shard)
        except ValueError:
            raise
        except Exception as exc:  # unreadable files: this adapter's error, never the engine's
            raise ValueError(f"LoRA adapter {path!r} could not be read: {exc}") from exc
        self.ops.add(slot, adapter)
        return adapter.num_bytes

    def remove(self, slot: int) -> None:
        self.ops.remove(slot)

    def token_rows(self, slots: list[int], num_tokens: list[int]) -> torch.Tensor | None:
        """Each scheduled token's slot (a request's slot for each of its `num_tokens`), [T] int64; None
        where no request has an adapter."""
        if all(slot < 0 for slot in slots):
            return None
        return torch.tensor([slot for slot, num in zip(slots, num_tokens) for _ in range(num)])

    def use_rows(self, rows: torch.Tensor | None) -> None:
        """The products that follow run row by row with these slots (-1 or None: the base)."""
        self.ops.set_rows(rows)

    def use_slot(self, slot: int) -> None:
        """Every row of the products that follow is one request's, with the adapter in `slot` (-1: none)."""
        self.ops.set_slot(slot)
