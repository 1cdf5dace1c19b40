"""The KV block pool: which blocks are free and which request holds which, pure Python plus numpy
(engine-core process). It returns block ids; the scheduler decides what to do with them.

Placement keeps each request's blocks adjacent where it can: a request grows into the block after its
last one when that is free, and a request that needs a fresh place starts in the middle of the largest
free gap, leaving room on both sides. Adjacent blocks let the worker read a context in place.

With prefix caching, blocks are reference counted: full blocks whose KV is written are indexed by
their prefix (coreserve/engine_core/prefix_index.py), requests share them, and a block no request holds keeps
its content until a fresh block is needed and it is the least recently freed. Such blocks count as
free: at idle every block is free or held only by the cache. With a KV event log (coreserve/engine_core/kv_event_log.py)
each content newly indexed, evicted, forgotten or cleared is told to it as it happens.
"""

from __future__ import annotations

import numpy as np

from coreserve.engine_core.kv_event_log import KVEventLog
from coreserve.engine_core.prefix_index import PrefixIndex
from coreserve.engine_core.prompt_rows import Flavour, PromptRows
from coreserve.engine_core.state_snapshots import StateSnapshots


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 events: KVEventLog | None = None, first_content_id: int = 1,
                 snapshots: StateSnapshots | None = None) -> None:
        """`snapshots`: a hybrid model's (its cached prefixes restore the recurrent state too)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._is_free = np.ones(num_blocks, dtype=bool)  # empty: held by no request, indexing nothing
        self._num_free = num_blocks
        self._num_refs = [0] * num_blocks  # requests holding each block
        self._req_blocks: dict[str, list[int]] = {}
        self._req_chain: dict[str, list[int]] = {}  # content ids of a request's first indexed blocks
        self.index = PrefixIndex(first_content_id) if enable_prefix_caching else None
        self.prompt_rows = PromptRows(block_size)  # prompt logprob rows of indexed blocks
        self._unindexed: set[str] = set()  # requests holding blocks from before a prefix-cache reset
        self.num_queried_tokens = 0  # prompt tokens of requests that looked their prefix up
        self.num_hit_tokens = 0  # of those, tokens found in the cache
        self.events = events if enable_prefix_caching else None
        self.snapshots = snapshots if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        return self._num_free + (self.index.num_evictable if self.index is not None else 0)

    @property
    def num_cached_blocks(self) -> int:
        return self.index.num_cached_blocks if self.index is not None else 0

    def take_cached_prefix(
        self,
        req_id: str,
        token_ids: list[int],
        max_tokens: int,
        flavour: Flavour | None = None,
        salt: str | None = None,
        is_long_rope: bool = False,
    ) -> int:
        """Gives a request that holds no blocks the indexed blocks of its longest cached prefix of full
        blocks within `max_tokens`, under its cache `salt` and its LongRoPE factors (PrefixIndex.root_of);
        returns how many tokens they hold (0 without prefix caching). With a prompt-logprob `flavour`,
        only blocks that keep that flavour's rows for this prompt count."""
        assert not self._req_blocks.get(req_id), "a request takes its cached prefix before any block"
        if self.index is None:
            return 0
        size, blocks, chain = self.block_size, [], []
        for start in range(0, max_tokens - size + 1, size):
            parent = chain[-1] if chain else self.index.root_of(salt, is_long_rope)
            block = self.index.lookup(parent, tuple(token_ids[start : start + size]))
            if block is None:
                break
            if flavour is not None and not self.prompt_rows.can_read(block, flavour, token_ids[start + size]):
                break
            if self._num_refs[block] == 0:
                self.index.reuse(block)
            self._num_refs[block] += 1
            blocks.append(block)
            chain.append(self.index.content_id(block))
        if self.snapshots is not None:  # a hybrid's prefix ends where its recurrent state was kept
            num_kept = self.snapshots.restorable(req_id, blocks)
            self._release(blocks[num_kept:])  # cached blocks past its last snapshot: not kept
            blocks, chain = blocks[:num_kept], chain[:num_kept]
        self._req_blocks[req_id], self._req_chain[req_id] = blocks, chain
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += len(blocks) * size
        return len(blocks) * size

    def cut_chunk(self, num_computed: int, num_new: int) -> int:
        """A chunk's tokens: a hybrid's end at its next snapshot boundary (StateSnapshots.cut)."""
        return num_new if self.snapshots is None else self.snapshots.cut(num_computed, num_new)

    def plan_snapshot(self, req_id: str, num_computed: int) -> int | None:
        """The snapshot slot the worker copies the request's state into after this step; None: none."""
        return None if self.snapshots is None else self.snapshots.plan(req_id, num_computed)

    def restore_slot(self, req_id: str) -> int:
        """The snapshot slot a newly admitted request's state starts from; -1: from zeros."""
        return -1 if self.snapshots is None else self.snapshots.restore_slot(req_id)

    def cache_full_blocks(
        self,
        req_id: str,
        prompt_ids: list[int],
        output_ids: list[int],
        num_computed: int,
        salt: str | None = None,
        is_long_rope: bool = False,
        lora: tuple[int, str] | None = None,
    ) -> list[tuple[int, int]]:
        """Indexes the request's full blocks whose KV is written (positions below `num_computed`), under
        its cache `salt` and its LongRoPE factors; returns the newly indexed ones as (block number in the
        request, the block holding the content). `lora` (its adapter's int id and name) is for the events.
        A hybrid's snapshots of the step go with the blocks indexed at their boundaries."""
        indexed = self._index_full_blocks(req_id, prompt_ids, output_ids, num_computed, salt, is_long_rope, lora)
        if self.snapshots is not None:
            self.snapshots.attach(req_id, indexed)
        return indexed

    def _index_full_blocks(
        self, req_id: str, prompt_ids: list[int], output_ids: list[int], num_computed: int,
        salt: str | None, is_long_rope: bool, lora: tuple[int, str] | None,
    ) -> list[tuple[int, int]]:
        if self.index is None or req_id in self._unindexed:
            return []
        chain = self._req_chain.setdefault(req_id, [])
        if chain and not self.index.is_live(chain[-1]):  # its prefix's content (another's block) is gone:
            self._unindexed.add(req_id)  # what follows could never be found again
            return []
        blocks, size = self._req_blocks[req_id], self.block_size
        indexed, stored = [], []  # stored: (parent content id or None, content id, tokens) of new contents
        for i in range(len(chain), min(num_computed // size, len(blocks))):
            tokens = _token_slice(prompt_ids, output_ids, i * size, (i + 1) * size)
            parent = chain[-1] if chain else self.index.root_of(salt, is_long_rope)
            chain.append(self.index.insert(parent, tokens, blocks[i]))
            holder = self.index.lookup(parent, tokens)
            indexed.append((i, holder))
            if self.events is not None and holder == blocks[i]:
                stored.append((chain[-2] if len(chain) > 1 else None, chain[-1], tokens))
        if stored:
            self._tell_stored(stored, lora)
        return indexed

    def _tell_stored(self, stored: list[tuple[int | None, int, tuple[int, ...]]], lora: tuple[int, str] | None) -> None:
        """One BlockStored per run of new contents that follow each other in the chain."""
        run: list[tuple[int | None, int, tuple[int, ...]]] = []
        for entry in stored:
            if run and entry[0] != run[-1][1]:
                self._tell_run(run, lora)
                run = []
            run.append(entry)
        self._tell_run(run, lora)

    def _tell_run(self, run: list[tuple[int | None, int, tuple[int, ...]]], lora: tuple[int, str] | None) -> None:
        self.events.stored([content for _, content, _ in run], run[0][0],
                           [token for *_, tokens in run for token in tokens], lora)

    def num_indexed_tokens(self, req_id: str) -> int:
        """Tokens of the request's prefix that other requests can now read from the cache."""
        return len(self._req_chain.get(req_id, ())) * self.block_size

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
        if num_new > self.num_free_blocks:
            return None
        new_blocks = []
        next_block = blocks[-1] + 1 if blocks else -1
        for _ in range(num_new):
            if self._num_free == 0:  # only cached blocks are left: the least recently freed is rewritten
                next_block, content_id = self.index.evict_oldest()
                self.prompt_rows.drop(next_block)
                if self.snapshots is not None:
                    self.snapshots.drop_block(next_block)
                if self.events is not None:
                    self.events.removed(content_id)
            else:
                if not (0 <= next_block < self.num_blocks and self._is_free[next_block]):
                    next_block = self._fresh_start()
                self._is_free[next_block] = False
                self._num_free -= 1
            self._num_refs[next_block] = 1
            new_blocks.append(next_block)
            next_block += 1
        self._req_blocks[req_id] = blocks + new_blocks
        return new_blocks

    def free(self, req_id: str) -> None:
        """Releases the request's blocks, its last ones first, so that a prefix's tail is evicted first."""
        self._req_chain.pop(req_id, None)
        self._unindexed.discard(req_id)
        if self.snapshots is not None:
            self.snapshots.drop_request(req_id)
        self._release(self._req_blocks.pop(req_id, []))

    def _release(self, blocks: list[int]) -> None:
        """A request lets go of `blocks`, its last ones first: a block no request holds is evictable
        where the prefix cache indexes it, else free."""
        for block in reversed(blocks):
            self._num_refs[block] -= 1
            if self._num_refs[block] > 0:
                continue
            if self.index is not None and self.index.is_cached(block):
                self.index.release(block)
            else:
                self._is_free[block] = True
                self._num_free += 1

    def reset_prefix_cache(self) -> None:
        """Forgets every indexed prefix (new weights make their KV stale): blocks no request holds
        become free; held ones stay their requests' but are never indexed (their KV is the old one)."""
        if self.index is None:
            return
        for block in range(self.num_blocks):
            if self.index.is_cached(block) and self._num_refs[block] == 0:
                self._is_free[block] = True
                self._num_free += 1
        self.index = PrefixIndex(self.index.next_content_id)
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.events is not None:
            self.events.cleared()
        self.prompt_rows.clear()
        self._req_chain = {req_id: [] for req_id in self._req_blocks}
        self._unindexed.update(self._req_blocks)

    def forget_lora_load(self, slot: int) -> None:
        """A LoRA load is gone (replaced, unloaded or trimmed): the chains keyed by it can never be read
        again, so they are forgotten now (their blocks free, or their requests' until they end) and
        their removal told, rather than kept until evicted."""
        if self.index is None:
            return

        def is_forgotten(root) -> bool:
            if isinstance(root, tuple) and root[0] == "long_rope":
                root = root[1]
            return isinstance(root, tuple) and root[0] == "lora" and root[1] == slot

        for block, content_id, was_evictable in self.index.forget_roots(is_forgotten):
            self.prompt_rows.drop(block)
            if self.snapshots is not None:
                self.snapshots.drop_block(block)
            if was_evictable:
                self._is_free[block] = True
                self._num_free += 1
            if self.events is not None:
                self.events.removed(content_id)

    def _fresh_start(self) -> int:
        """The middle of the largest free gap (its start, when the gap opens the pool)."""
        padded = np.concatenate(([False], self._is_free, [False]))
        edges = np.flatnonzero(np.diff(padded.astype(np.int8)))
        starts, ends = edges[0::2], edges[1::2]
        largest = int(np.argmax(ends - starts))
        start, length = int(starts[largest]), int(ends[largest] - starts[largest])
        return start if start == 0 else start + length // 2


def _token_slice(prompt_ids: list[int], output_ids: list[int], start: int, end: int) -> tuple[int, ...]:
    """Tokens start..end - 1 of prompt + output, without building the whole sequence."""
    num_prompt = len(prompt_ids)
    if end <= num_prompt:
        return tuple(prompt_ids[start:end])
    if start >= num_prompt:
        return tuple(output_ids[start - num_prompt : end - num_prompt])
    return tuple(prompt_ids[start:]) + tuple(output_ids[: end - num_prompt])
