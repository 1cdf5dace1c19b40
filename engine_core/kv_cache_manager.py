"""The KV block pool: which blocks are free and which request holds which, pure Python plus numpy
(engine-core process). It returns block ids; the scheduler decides what to do with them.

Placement keeps each request's blocks adjacent where it can: a request grows into the block after its
last one when that is free, and a request that needs a fresh place starts in the middle of the largest
free gap, leaving room on both sides. Adjacent blocks let the worker read a context in place.
"""

from __future__ import annotations

import numpy as np


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks
        self._req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def blocks_of(self, req_id: str) -> list[int]:
        return self._req_blocks.get(req_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grows the request's blocks to hold `num_tokens`; returns the new block ids, or None (and no
        change) when the pool cannot provide them."""
        blocks = self._req_blocks.get(req_id, [])
        num_new = self.num_blocks_needed(num_tokens) - len(blocks)
        if num_new <= 0:
            return []
        if num_new > self._num_free:
            return None
        new_blocks = []
        next_block = blocks[-1] + 1 if blocks else -1
        for _ in range(num_new):
            if not (0 <= next_block < self.num_blocks and self._is_free[next_block]):
                next_block = self._fresh_start()
            self._is_free[next_block] = False
            new_blocks.append(next_block)
            next_block += 1
        self._num_free -= num_new
        self._req_blocks[req_id] = blocks + new_blocks
        return new_blocks

    def free(self, req_id: str) -> None:
        blocks = self._req_blocks.pop(req_id, [])
        self._is_free[blocks] = True
        self._num_free += len(blocks)

    def _fresh_start(self) -> int:
        """The middle of the largest free gap (its start, when the gap opens the pool)."""
        padded = np.concatenate(([False], self._is_free, [False]))
        edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
        starts, ends = edges[0::2], edges[1::2]
        largest = int(np.argmax(ends - starts))
        start, length = int(starts[largest]), int(ends[largest] - starts[largest])
        return start if start == 0 else start + length // 2
