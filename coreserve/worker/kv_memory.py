"""A runner's KV cache memory (engine-core process, and each tensor-parallel rank): one zeroed
[2, Hkv, slots, D] tensor an attention layer from the backend, which binds its fast path to them, and a
draft model's cache beside (the proposer's). Sleep frees it (`free`), keeping the block count; wake
allocates it again, zeroed (`restore`); new weights rebind the backend to it (`rebind`).

A hybrid model's recurrent layers keep, in its place, a state cache: a slot a running sequence
(`LayerState`: the conv's last inputs and the recurrence's state), taken when a request enters the
runner (zeroed: a sequence starts from nothing) and given back when it leaves, finished or preempted
(a preempted request is computed again from its first token, or from a snapshot). With prefix caching,
snapshot slots beside: a request's state is copied into one after a step that ends on a boundary of
its chain, and a request whose cached prefix ends there starts from a copy of it
(coreserve/engine_core/state_snapshots.py). The core sizes both (coreserve/engine_core/hybrid_memory.py);
their pages are written only as slots are first used.

The runner's steps read `caches`; its control verbs (coreserve/worker/runner_control.py) free and
restore them. The block count itself is the core's (coreserve/engine_core/core.py sizes the pool).
"""

from __future__ import annotations

import logging
import time

import torch

from coreserve.worker.backend import Backend
from coreserve.worker.models.decoder import DecoderModel
from coreserve.worker.models.family import MAMBA2, SHORT_CONV
from coreserve.worker.models.gated_deltanet import LayerState
from coreserve.worker.speculative.proposers import Proposer

logger = logging.getLogger(__name__)


class KvMemory:
    def __init__(self, backend: Backend, model: DecoderModel, block_size: int, dtype: torch.dtype,
                 device: torch.device, proposer: Proposer | None) -> None:
        self.backend = backend
        self.is_on_host = device.type == "cpu"  # host memory, which the core checks the cache fits in
        self.model = model  # its args: this rank's share of the KV heads
        self.block_size = block_size
        self.dtype = dtype  # the activations' and the cache's
        self.proposer = proposer  # a draft model's cache, sized alike; None: no speculation, or n-grams'
        # a layer's [2, Hkv, num_blocks * block_size, D] (a recurrent layer's LayerState); [] asleep
        self.caches: list[torch.Tensor | LayerState] = []
        self.num_blocks = 0  # what the cache holds, kept through a sleep for the wake
        self.num_state_slots = 0  # a hybrid's state cache, kept through a sleep too
        self.num_snapshot_slots = 0
        self.free_state_slots: list[int] = []
        self.snapshots: list[LayerState] = []  # a recurrent layer's snapshot slots, in layer order

    def bytes_per_block(self) -> int:
        a = self.model.args
        return 2 * len(a.attention_layers) * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def host_kv_bytes(self, num_blocks: int) -> int:
        """The host memory a cache of num_blocks takes (a draft model's too): all of it on the CPU, none
        on a GPU."""
        draft = 0 if self.proposer is None else self.proposer.host_kv_bytes(num_blocks)
        return (num_blocks * self.bytes_per_block() if self.is_on_host else 0) + draft

    def allocate(self, num_blocks: int, num_state_slots: int = 0, num_snapshot_slots: int = 0) -> None:
        begun = time.perf_counter()
        a = self.model.args
        shape = (2, a.num_kv_heads, num_blocks * self.block_size, a.head_dim)
        kv = iter(self.backend.allocate_kv_cache(len(a.attention_layers), shape, self.dtype))
        self.caches = [next(kv) if spec.mixer == "attention" else self._states(num_state_slots, spec.mixer)
                       for spec in a.layers]
        if num_state_slots != self.num_state_slots:  # the first allocation; a wake keeps who holds what (the
            self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # slept requests give theirs back)
        self.num_blocks, self.num_state_slots = num_blocks, num_state_slots
        self.num_snapshot_slots = num_snapshot_slots
        mixers = [spec.mixer for spec in a.layers if spec.mixer != "attention"]
        self.snapshots = [self._states(num_snapshot_slots, mixer) for mixer in mixers] if num_snapshot_slots else []
        if not a.is_hybrid:  # the fused decode forward reads attention layers only
            self.backend.bind(self.model, self.caches)
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB); startup: KV cache %.3f s", num_blocks,
                    self.block_size, num_blocks * self.bytes_per_block() / 2**20, time.perf_counter() - begun)

    def _states(self, num_slots: int, mixer: str) -> LayerState:
        """A recurrent layer's slots, unwritten (a slot is zeroed when taken): a Gated DeltaNet's conv and
        recurrent states, a short conv's conv state, a Mamba2's conv and SSM states."""
        a = self.model.args
        assert num_slots > 0, "a hybrid model needs state slots"
        device = self.caches_device
        if mixer == SHORT_CONV:
            assert a.short_conv is not None
            return LayerState(torch.empty(num_slots, a.short_conv.kernel - 1, a.hidden_size, device=device), None)
        if mixer == MAMBA2:
            m = a.mamba
            assert m is not None
            return LayerState(torch.empty(num_slots, m.conv_kernel - 1, m.conv_dim, device=device),
                              torch.empty(num_slots, m.num_heads, m.head_dim, m.state_size, device=device))
        lin = a.linear
        assert lin is not None
        conv = torch.empty(num_slots, lin.conv_kernel - 1, lin.conv_dim, device=device)
        recurrent = torch.empty(num_slots, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim, device=device)
        return LayerState(conv, recurrent)

    @property
    def caches_device(self) -> torch.device:
        return torch.device("cpu") if self.is_on_host else self.model.embed_tokens.weight.device

    def _layer_states(self) -> list[LayerState]:
        return [cache for cache in self.caches if isinstance(cache, LayerState)]

    def take_state_slot(self, snapshot: int = -1) -> int:
        """A free slot of the state cache: zeroed in every recurrent layer (a sequence's start), or a copy
        of snapshot slot `snapshot` (its cached prefix's)."""
        slot = self.free_state_slots.pop()  # the core runs no more requests than slots
        for index, cache in enumerate(self._layer_states()):
            for part_index, part in enumerate(cache):
                if part is None:
                    continue
                if snapshot < 0:
                    part[slot].zero_()
                else:
                    part[slot].copy_(self.snapshots[index][part_index][snapshot])
        return slot

    def save_snapshot(self, slot: int, snapshot: int) -> None:
        """State slot `slot` (a request's, after a step that ended on a boundary) into snapshot slot `snapshot`."""
        for cache, kept in zip(self._layer_states(), self.snapshots):
            for part, kept_part in zip(cache, kept):
                if part is not None:
                    kept_part[snapshot].copy_(part[slot])

    def give_state_slot(self, slot: int) -> None:
        self.free_state_slots.append(slot)

    def free(self) -> None:
        """Sleep: the caches go (the backend drops what reads them first); the block count stays."""
        self.backend.release()
        self.caches, self.snapshots = [], []
        if self.proposer is not None:
            self.proposer.release()

    def restore(self) -> None:
        """Wake: the caches of the kept block count again, zeroed (nothing where they are here)."""
        if not self.caches and self.num_blocks:
            self.allocate(self.num_blocks, self.num_state_slots, self.num_snapshot_slots)

    def rebind(self) -> None:
        """The weights moved: what the backend derived from their addresses and the caches', again."""
        if self.caches and not self.model.args.is_hybrid:
            self.backend.bind(self.model, self.caches)
