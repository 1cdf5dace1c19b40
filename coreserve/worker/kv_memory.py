"""A runner's KV cache memory (engine-core process, and each tensor-parallel rank): one zeroed
[2, Hkv, slots, D] tensor a layer from the backend, which binds its fast path to them, and a draft
model's cache beside (the proposer's). Sleep frees it (`free`), keeping the block count; wake allocates
it again, zeroed (`restore`); new weights rebind the backend to it (`rebind`).

The runner's steps read `caches`; its control verbs (coreserve/worker/runner_control.py) free and
restore them. The block count itself is the core's (coreserve/engine_core/core.py sizes the pool).
"""

from __future__ import annotations

import logging
import time

import torch

from coreserve.worker.backend import Backend
from coreserve.worker.models.decoder import DecoderModel
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
        self.caches: list[torch.Tensor] = []  # a layer's [2, Hkv, num_blocks * block_size, D]; [] asleep
        self.num_blocks = 0  # what the cache holds, kept through a sleep for the wake

    def bytes_per_block(self) -> int:
        a = self.model.args
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def host_kv_bytes(self, num_blocks: int) -> int:
        """The host memory a cache of num_blocks takes (a draft model's too): all of it on the CPU, none
        on a GPU."""
        draft = 0 if self.proposer is None else self.proposer.host_kv_bytes(num_blocks)
        return (num_blocks * self.bytes_per_block() if self.is_on_host else 0) + draft

    def allocate(self, num_blocks: int) -> None:
        begun = time.perf_counter()
        a = self.model.args
        shape = (2, a.num_kv_heads, num_blocks * self.block_size, a.head_dim)
        self.caches = self.backend.allocate_kv_cache(a.num_layers, shape, self.dtype)
        self.num_blocks = num_blocks
        self.backend.bind(self.model, self.caches)
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB); startup: KV cache %.3f s", num_blocks,
                    self.block_size, num_blocks * self.bytes_per_block() / 2**20, time.perf_counter() - begun)

    def free(self) -> None:
        """Sleep: the caches go (the backend drops what reads them first); the block count stays."""
        self.backend.release()
        self.caches = []
        if self.proposer is not None:
            self.proposer.release()

    def restore(self) -> None:
        """Wake: the caches of the kept block count again, zeroed (nothing where they are here)."""
        if not self.caches and self.num_blocks:
            self.allocate(self.num_blocks)

    def rebind(self) -> None:
        """The weights moved: what the backend derived from their addresses and the caches', again."""
        if self.caches:
            self.backend.bind(self.model, self.caches)
