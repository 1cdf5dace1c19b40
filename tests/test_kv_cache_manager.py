"""The block pool: allocation, refusal when short, and freeing."""

from __future__ import annotations

from engine_core.kv_cache_manager import KVCacheManager


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
