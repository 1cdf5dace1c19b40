"""The prefix cache's events as they happen (engine-core process): the KV block pool tells a
`KVEventLog` each content it newly indexes, each it evicts or forgets, and each reset; the engine takes
them after each step and hands them to the publisher (coreserve/engine_core/kv_event_publisher.py). Pure Python.

The log mirrors the prefix index exactly: a block is announced when its content is first indexed (an
equal block indexed before is not: it stays private, as the index keeps it), removed when evicted or
forgotten, and a reset clears everything. So a subscriber that applies the events in order holds the
index's contents, content id for content id.
"""

from __future__ import annotations

from coreserve.engine_core.kv_events import MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVEventLog:
    """Events since the last `take`, in the order the pool made them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(self, block_hashes: list[int], parent: int | None, token_ids: list[int],
               lora: tuple[int, str] | None = None) -> None:
        """Full blocks newly indexed in chain order after `parent` (None: a prompt's first block);
        `lora`: the adapter's (int id, name) whose KV they hold."""
        lora_id, lora_name = lora if lora is not None else (None, None)
        self._events.append(BlockStored(block_hashes=block_hashes, parent_block_hash=parent, token_ids=token_ids,
                                        block_size=self.block_size, lora_id=lora_id, medium=MEDIUM,
                                        lora_name=lora_name))

    def removed(self, block_hash: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # one event for evictions in a row
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
