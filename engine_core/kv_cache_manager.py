"""The KV block pool: free list and reference counts, pure Python (engine-core process).

It returns block ids; the scheduler decides what to do with them. Reference counts let blocks be
shared later (prefix caching) without changing the callers.
"""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_of(self, req_id: str) -> list[int]:
        return self._req_blocks.get(req_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grows the request's blocks to hold `num_tokens`; returns the new block ids, or None (no change)
        when the pool cannot provide them."""
        blocks = self._req_blocks.setdefault(req_id, [])
        num_new = self.num_blocks_needed(num_tokens) - len(blocks)
        if num_new <= 0:
            return []
        if num_new > len(self._free):
            if not blocks:
                del self._req_blocks[req_id]
            return None
        new_blocks = [self._free.popleft() for _ in range(num_new)]
        for block in new_blocks:
            self._ref_counts[block] += 1
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, req_id: str) -> None:
        for block in reversed(self._req_blocks.pop(req_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
