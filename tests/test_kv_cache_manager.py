"""The block pool: allocation, refusal when short, and freeing."""

from __future__ import annotations

from coreserve.engine_core.kv_cache_manager import KVCacheManager


def test_allocates_whole_blocks_and_grows_only_when_needed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert len(kv.allocate("a", 5)) == 2
    assert kv.allocate("a", 8) == []
    assert len(kv.allocate("a", 9)) == 1
    assert kv.num_free_blocks == 5


def test_refuses_without_side_effects_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate("a", 8)
    assert kv.allocate("b", 9) is None
    assert kv.num_free_blocks == 1
    assert kv.blocks_of("b") == []


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate("a", 3)
    kv.allocate("b", 4)
    kv.free("a")
    kv.free("b")
    kv.free("never-allocated")
    assert kv.num_free_blocks == 4


def test_the_event_log_mirrors_the_index_when_a_chains_prefix_is_another_requests_block():
    """B computed the same first block as A privately (its chain goes on from A's content); A ends and
    its block is evicted: B's next full block would hang from a content gone, which no request could
    ever find, so it is not indexed, and no event names a parent that was removed."""
    from coreserve.engine_core.kv_event_log import KVEventLog
    from coreserve.engine_core.kv_events import BlockRemoved, BlockStored

    log = KVEventLog(block_size=2)
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True, events=log)
    kv.allocate("a", 2)
    kv.allocate("b", 2)
    assert kv.cache_full_blocks("a", [1, 2], [], 2) == [(0, kv.blocks_of("a")[0])]
    kv.cache_full_blocks("b", [1, 2], [], 2)  # the same content: B's block stays private
    stored = log.take()
    assert [type(e) for e in stored] == [BlockStored] and stored[0].parent_block_hash is None
    kv.free("a")
    kv.allocate("c", 4)  # the two free blocks
    assert log.take() == []
    kv.allocate("b", 4)  # only A's block is left: evicted
    assert [type(e) for e in log.take()] == [BlockRemoved]
    assert kv.cache_full_blocks("b", [1, 2, 3, 4], [], 4) == [] and log.take() == []
    assert kv.index.contents() == {}
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 4
