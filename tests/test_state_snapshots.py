"""A hybrid model's prefix cache in the scheduler (coreserve/engine_core/state_snapshots.py), pure logic: a
shadow worker keeps each request's "state" as the tokens it has consumed and each snapshot slot as the
state copied into it; a request that starts from a cached prefix must find in its snapshot slot exactly
that prefix's state, chunks must end where snapshots are taken, and every slot comes back. Under shared
prefixes, aborts, preemption and a cache smaller than the working set (evictions).
"""

from __future__ import annotations

import random

from test_prefix_cache import BLOCK, ShadowWorker, make_request, random_traffic

from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.scheduler import Scheduler
from coreserve.engine_core.state_snapshots import StateSnapshots

EVERY_BLOCKS = 2


class HybridShadowWorker(ShadowWorker):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.states: dict[str, tuple[int, ...]] = {}
        self.snapshots: dict[int, tuple[int, ...]] = {}
        self.num_restored = 0

    def execute(self, out, scheduler: Scheduler):
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.new_reqs:
            prefix = tuple(new.token_ids[: new.num_computed_tokens])
            if new.state_snapshot >= 0:
                assert self.snapshots[new.state_snapshot] == prefix, "a snapshot of another prefix"
                self.num_restored += 1
            assert (new.state_snapshot >= 0) == bool(prefix), "a cached prefix without its state"
            self.states[new.req_id] = prefix
        result = super().execute(out, scheduler)
        for req_id, num in out.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            assert len(self.states[req_id]) == req.num_computed_tokens - num, "a state out of step"
            self.states[req_id] += tuple(req.all_token_ids[req.num_computed_tokens - num : req.num_computed_tokens])
        for req_id, slot in out.state_snapshots.items():
            assert len(self.states[req_id]) % (EVERY_BLOCKS * BLOCK) == 0, "a snapshot off a boundary"
            self.snapshots[slot] = self.states[req_id]
        return result


def test_every_restored_state_is_its_prefix_under_aborts_preemption_and_eviction():
    rng = random.Random(11)
    num_blocks, num_slots = 24, 6
    snapshots = StateSnapshots(num_slots, EVERY_BLOCKS, BLOCK)
    scheduler = Scheduler(KVCacheManager(num_blocks, BLOCK, True, snapshots=snapshots), 8, 32, max_model_len=128)
    worker = HybridShadowWorker(num_blocks)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    random_traffic(scheduler, worker, rng, prefixes, 800)
    assert worker.num_restored > 50 and scheduler.num_preemptions > 0
    assert scheduler.kv_cache.num_hit_tokens % (EVERY_BLOCKS * BLOCK) == 0
    kv = scheduler.kv_cache
    assert kv.num_free_blocks == num_blocks
    assert len(snapshots._free) + snapshots.num_snapshots == num_slots  # none lost
    kv.reset_prefix_cache()
    assert len(snapshots._free) == num_slots


def test_a_chunk_stops_at_its_last_boundary_and_a_hit_lands_on_one():
    snapshots = StateSnapshots(4, EVERY_BLOCKS, BLOCK)
    scheduler = Scheduler(KVCacheManager(32, BLOCK, True, snapshots=snapshots), 8, 64, max_model_len=128)
    worker = HybridShadowWorker(32)
    prompt = list(range(1, 3 * EVERY_BLOCKS * BLOCK - 2))  # two boundaries inside, the third past its end
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    out = scheduler.schedule()  # a 64-token budget passes both boundaries: cut at the second
    assert out.num_scheduled_tokens == {"a": 2 * EVERY_BLOCKS * BLOCK} and out.state_snapshots == {"a": 0}
    scheduler.update_from_output(out, worker.execute(out, scheduler))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, worker.execute(out, scheduler))
    assert snapshots.num_snapshots == 1  # none at the first boundary, inside the first chunk
    scheduler.add_request(make_request("b", prompt + [7, 8], max_tokens=1))
    out = scheduler.schedule()
    assert out.new_reqs[0].num_computed_tokens == 2 * EVERY_BLOCKS * BLOCK and out.new_reqs[0].state_snapshot == 0
    assert out.num_scheduled_tokens == {"b": len(prompt) + 2 - 2 * EVERY_BLOCKS * BLOCK}
