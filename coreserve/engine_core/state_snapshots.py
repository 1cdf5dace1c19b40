"""A hybrid model's prefix cache (engine-core process): where a cached prefix can restore the recurrent
state too. The KV blocks of a prefix are not enough for a model with recurrent layers (Qwen3.5's Gated
DeltaNet): their state after the prefix's last token is needed as well. So the state is kept, in the
worker's snapshot slots (coreserve/worker/kv_memory.py), at boundaries every `every_blocks` blocks of a
chain: a prefill chunk that passes boundaries is cut at the last of them, and the request's state after
that step is copied into a slot tied to the boundary's block (the boundaries inside a chunk get none). A request's cached prefix then ends at the last boundary
of its chain that has a snapshot; the worker starts its state from that slot. A snapshot goes with its
block (evicted, reset, forgotten); with no free slot no snapshot is taken (the prefix is then computed).

Pure Python; the KV cache manager (coreserve/engine_core/kv_cache_manager.py) owns one.
"""

from __future__ import annotations


class StateSnapshots:
    def __init__(self, num_slots: int, every_blocks: int, block_size: int) -> None:
        assert num_slots > 0 and every_blocks > 0
        self.every_blocks = every_blocks
        self.every_tokens = every_blocks * block_size
        self.block_size = block_size
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}  # a cached block at a boundary -> the slot of the state after it
        self._pending: dict[str, list[tuple[int, int]]] = {}  # req_id -> (block number, slot) of this step
        self._restore: dict[str, int] = {}  # req_id -> the slot its cached prefix starts from

    @property
    def num_snapshots(self) -> int:
        return len(self._slot_of)

    def cut(self, num_computed: int, num_new: int) -> int:
        """A chunk's tokens, ending at the last boundary it passes (a snapshot there), else all num_new."""
        last_boundary = (num_computed + num_new) // self.every_tokens * self.every_tokens
        return last_boundary - num_computed if last_boundary > num_computed else num_new

    def plan(self, req_id: str, num_computed: int) -> int | None:
        """A slot for the request's state after this step, where its computed tokens end on a boundary
        (and a slot is free); None: no snapshot this step."""
        if num_computed % self.every_tokens or not self._free:
            return None
        slot = self._free.pop()
        self._pending.setdefault(req_id, []).append((num_computed // self.block_size - 1, slot))
        return slot

    def restorable(self, req_id: str, blocks: list[int]) -> int:
        """How many of `blocks` (a cached prefix's, in order) a request may take: up to the last boundary
        block with a snapshot, whose slot the request's state is restored from (`restore_slot`)."""
        for count in range(len(blocks) // self.every_blocks * self.every_blocks, 0, -self.every_blocks):
            slot = self._slot_of.get(blocks[count - 1])
            if slot is not None:
                self._restore[req_id] = slot
                return count
        return 0

    def restore_slot(self, req_id: str) -> int:
        """The slot the request's state starts from (read once, at its admission); -1: from zeros."""
        return self._restore.pop(req_id, -1)

    def attach(self, req_id: str, indexed: list[tuple[int, int]]) -> None:
        """The step ran: each snapshot planned for the request goes with the block now indexed at its
        boundary (`indexed`: (block number in the request, the block holding that content)); a boundary
        whose content already has a snapshot, or was not indexed, gives its slot back."""
        holder_of = dict(indexed)
        for number, slot in self._pending.pop(req_id, ()):
            holder = holder_of.get(number)
            if holder is None or holder in self._slot_of:
                self._free.append(slot)
            else:
                self._slot_of[holder] = slot

    def drop_block(self, block: int) -> None:
        """A cached block is gone (evicted or forgotten): its snapshot too."""
        slot = self._slot_of.pop(block, None)
        if slot is not None:
            self._free.append(slot)

    def drop_request(self, req_id: str) -> None:
        """A request left before its step's snapshots were attached (preempted, aborted)."""
        self._free.extend(slot for _, slot in self._pending.pop(req_id, ()))
        self._restore.pop(req_id, None)

    def clear(self) -> None:
        """Every cached prefix forgotten (new weights): every attached snapshot with it."""
        self._free.extend(self._slot_of.values())
        self._slot_of.clear()
