"""Which KV blocks hold which token prefixes (engine-core process): the prefix cache's index, pure Python.

A full block is keyed by (the content id of the block before it, the block's token ids): a chain, so a
key names the whole prefix up to and including that block. A salted request's chain starts from its
salt's own root (vLLM's cache_salt), so it meets only chains of the same salt; a request on LongRoPE's
long factors (its keys rotated unlike the short factors' of the same tokens) from a root of its own.
Content ids are never reused (an evicted block's successor chain can never be matched again), and dict
keys compare the token tuples exactly: no hash collision can ever hand out the wrong KV. Everything else
that changes the KV (model, dtype) is fixed for one engine, so it is not part of the key. Blocks no
request holds stay indexed and are evicted least recently freed first, only when a fresh block is needed.
"""

from __future__ import annotations

from collections import OrderedDict

ROOT = 0  # the content id "before" a prompt's first block

Root = int | str | tuple[str, int | str]  # the parent of a prompt's first block (root_of)
BlockKey = tuple[int | Root, tuple[int, ...]]  # (the parent's content id, or a first block's root; tokens)


class PrefixIndex:
    def __init__(self, first_content_id: int = ROOT + 1) -> None:
        """`first_content_id`: where a reset's new index goes on counting, so no id names two contents."""
        self._block_of: dict[BlockKey, int] = {}  # key -> block holding that content
        self._entry_of: dict[int, tuple[BlockKey, int]] = {}  # block -> (its key, its content id)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed blocks no request holds, LRU first
        self._live: set[int] = set()  # the content ids indexed now
        self.next_content_id = first_content_id

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entry_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._entry_of

    def content_id(self, block: int) -> int:
        return self._entry_of[block][1]

    @staticmethod
    def root_of(salt: str | None, is_long_rope: bool = False) -> Root:
        """The parent of a prompt's first block: ROOT unsalted, else the salt itself (a string, never a
        content id), so salted chains meet no other chain and nothing is kept per salt. On LongRoPE's
        long factors: that root in a tuple, which equals no salt and no id."""
        root = ROOT if salt is None else salt
        return ("long_rope", root) if is_long_rope else root

    def contents(self) -> dict[int, tuple[int | None, tuple[int, ...]]]:
        """Every indexed content: content id -> (its parent's content id, None for a chain's first block;
        its tokens). What a subscriber of the KV events holds (coreserve/engine_core/kv_event_log.py)."""
        return {content_id: (parent if isinstance(parent, int) and parent != ROOT else None, tokens)
                for (parent, tokens), content_id in self._entry_of.values()}

    def lookup(self, parent: int | Root, token_ids: tuple[int, ...]) -> int | None:
        return self._block_of.get((parent, token_ids))

    def insert(self, parent: int | Root, token_ids: tuple[int, ...], block: int) -> int:
        """Indexes a block whose KV is written; returns the content id of the block that holds it (an
        equal block indexed before keeps its place, and this one stays private)."""
        key = (parent, token_ids)
        existing = self._block_of.get(key)
        if existing is not None:
            return self._entry_of[existing][1]
        content_id = self.next_content_id
        self.next_content_id += 1
        self._block_of[key] = block
        self._entry_of[block] = (key, content_id)
        self._live.add(content_id)
        return content_id

    def is_live(self, content_id: int) -> bool:
        """Whether `content_id` is indexed now (a chain may go on from it)."""
        return content_id in self._live

    def release(self, block: int) -> None:
        """No request holds `block` any more: it may be evicted, after the blocks released before it."""
        self._evictable[block] = None

    def reuse(self, block: int) -> None:
        """A request takes an indexed block no one held: it must not be evicted while held."""
        del self._evictable[block]

    def evict_oldest(self) -> tuple[int, int]:
        """Forgets the least recently released block; returns it, to be written anew, and the content id
        it held."""
        block, _ = self._evictable.popitem(last=False)
        key, content_id = self._entry_of.pop(block)
        del self._block_of[key]
        self._live.discard(content_id)
        return block, content_id

    def forget_roots(self, is_forgotten) -> list[tuple[int, int, bool]]:
        """Forgets every chain whose root `is_forgotten(root)` says no request can name again (a LoRA
        load gone), and every block after them: [(block, content id, whether no request held it)]. A
        child is indexed after its parent, so one pass in the order of indexing finds them all."""
        gone: set[int] = set()
        forgotten = []
        for block, ((parent, _), content_id) in list(self._entry_of.items()):
            is_root = not (isinstance(parent, int) and parent != ROOT)
            if (is_root and is_forgotten(parent)) or (not is_root and parent in gone):
                gone.add(content_id)
                key, _ = self._entry_of.pop(block)
                del self._block_of[key]
                self._live.discard(content_id)
                forgotten.append((block, content_id, self._evictable.pop(block, False) is None))
        return forgotten
