"""Prefix caching: the block index and pool (no model), the scheduler with a fake worker that writes
each position's token into a shadow cache (so a hit can be checked against what was really written),
and the engine on the built-in model against a cold cache."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import PROMPTS, assert_same_positions, free_blocks_are_all

from coreserve import LLM, SamplingParams
from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.request import Request
from coreserve.engine_core.scheduler import Scheduler
from coreserve.protocol.sampling_params import SamplingParams as Params
from coreserve.protocol.step import ModelRunnerOutput

BLOCK = 4


def test_a_cached_prefix_is_shared_and_stays_cached_when_freed():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    tokens = list(range(10))
    kv.allocate("a", 10)
    kv.cache_full_blocks("a", tokens, [], 10)  # two full blocks indexed
    assert kv.take_cached_prefix("b", tokens + [99], max_tokens=10) == 8
    assert kv.blocks_of("b") == kv.blocks_of("a")[:2]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.num_cached_blocks == 2
    assert kv.take_cached_prefix("c", tokens, max_tokens=9) == 8  # still there after both left
    assert kv.take_cached_prefix("d", [0, 1, 2, 7, 8], max_tokens=4) == 0  # first block differs


def test_the_last_token_is_never_read_from_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    kv.allocate("a", 9)
    kv.cache_full_blocks("a", list(range(8)), [5], 9)
    assert kv.take_cached_prefix("b", list(range(8)), max_tokens=7) == 4


def test_eviction_takes_the_least_recently_freed_and_forgets_it():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_prefix_caching=True)
    for name, first in (("a", 0), ("b", 100)):
        kv.allocate(name, 8)
        kv.cache_full_blocks(name, list(range(first, first + 8)), [], 8)
    kv.free("a")  # freed first: its blocks go first, tail before head
    kv.free("b")
    a_tail = kv.index.lookup(kv.index.content_id(kv.index.lookup(0, (0, 1, 2, 3))), (4, 5, 6, 7))
    assert kv.allocate("c", 4) == [a_tail]
    assert kv.take_cached_prefix("d", list(range(8)) + [0], max_tokens=8) == 4  # a's tail is gone
    assert kv.take_cached_prefix("e", list(range(100, 108)) + [0], max_tokens=8) == 8
    assert kv.num_free_blocks == 0


def make_request(req_id: str, prompt: list[int], client: bytes = b"c", **params) -> Request:
    sampling = Params(**{"max_tokens": 3, **params})
    return Request(
        req_id=req_id, client_id=client, client_req_id=req_id, prompt_token_ids=prompt, params=sampling,
        arrival_time=0.0, eos_token_ids=[], logprobs_mode="raw",
    )


class ShadowWorker:
    """Writes each scheduled position's token into a shadow of the cache and checks, whenever a
    request starts after cached positions, that those positions hold its own tokens."""

    def __init__(self, num_blocks: int) -> None:
        self.shadow = np.full((num_blocks, BLOCK), -1, dtype=np.int64)
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_checked_hits = 0

    def execute(self, out, scheduler: Scheduler) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.tables.pop(req_id, None)
        for new in out.new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
            for pos in range(new.num_computed_tokens):  # read from the cache: must be this prompt's
                block = new.block_ids[pos // BLOCK]
                assert self.shadow[block, pos % BLOCK] == new.token_ids[pos], "a cached block changed"
            self.num_checked_hits += new.num_computed_tokens > 0
        for cached in out.cached_reqs:
            self.tables[cached.req_id].extend(cached.new_block_ids)
        sampled = []
        for req_id, num in out.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            start = req.num_computed_tokens - num
            for pos in range(start, start + num):
                self.shadow[self.tables[req_id][pos // BLOCK], pos % BLOCK] = req.all_token_ids[pos]
            if req.num_computed_tokens == req.num_tokens:
                sampled.append(req_id)
        tokens = np.array([[hash((r, scheduler.requests[r].num_tokens)) % 50 + 1] for r in sampled], np.int32)
        return ModelRunnerOutput(sampled, tokens.reshape(len(sampled), 1))


def run_until_idle(scheduler: Scheduler, worker: ShadowWorker, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        out = scheduler.schedule()
        scheduler.update_from_output(out, worker.execute(out, scheduler))
    raise AssertionError("did not finish")


def random_traffic(scheduler: Scheduler, worker: ShadowWorker, rng, prefixes: list[list[int]], num_requests: int,
                   num_clients: int = 1) -> None:
    """`num_requests` requests, each a random one of `prefixes` and a few tokens more, from `num_clients`
    clients; one in ten of those in flight aborted; a step every third request; then until idle."""
    live: list[str] = []
    for i in range(num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
        client = bytes([i % num_clients])
        scheduler.add_request(make_request(f"r{i}", prompt, client=client, max_tokens=rng.randrange(1, 20)))
        live.append(f"r{i}")
        if rng.random() < 0.1:
            scheduler.abort_requests([live.pop(rng.randrange(len(live)))])
        if i % 3 == 0:
            out = scheduler.schedule()
            scheduler.update_from_output(out, worker.execute(out, scheduler))
    run_until_idle(scheduler, worker)


def test_n_completions_of_one_prompt_prefill_it_once():
    scheduler = Scheduler(KVCacheManager(64, BLOCK, True), 8, 256, max_model_len=128)
    prompt = list(range(1, 34))  # 33 tokens: 8 full blocks, the last token computed by each
    for i in range(8):
        scheduler.add_request(make_request(f"p#{i}", prompt))
    first = scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["p#0"]  # the others wait one step for its blocks
    worker = ShadowWorker(64)
    scheduler.update_from_output(first, worker.execute(first, scheduler))
    second = scheduler.schedule()
    assert all(second.num_scheduled_tokens[f"p#{i}"] == 1 for i in range(1, 8))
    assert scheduler.num_prefill_tokens == 33 + 7
    scheduler.update_from_output(second, worker.execute(second, scheduler))
    run_until_idle(scheduler, worker)
    assert scheduler.kv_cache.num_free_blocks == 64


def test_a_request_asking_for_prompt_logprobs_reads_no_block_without_its_rows():
    scheduler = Scheduler(KVCacheManager(64, BLOCK, True), 8, 256, max_model_len=128)
    worker = ShadowWorker(64)
    prompt = list(range(1, 20))
    scheduler.add_request(make_request("warm", prompt))
    run_until_idle(scheduler, worker)
    scheduler.add_request(make_request("plp", prompt, prompt_logprobs=1))
    scheduler.add_request(make_request("plain", prompt, client=b"d"))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"plp": 19, "plain": 3}


def test_stress_shared_prefixes_random_aborts_and_a_cache_smaller_than_the_working_set():
    rng = random.Random(7)
    num_blocks = 24  # 20 prefixes of up to 6 blocks each do not fit: blocks are evicted all along
    scheduler = Scheduler(KVCacheManager(num_blocks, BLOCK, True), 8, 32, max_model_len=128)
    worker = ShadowWorker(num_blocks)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 24))] for _ in range(20)]
    random_traffic(scheduler, worker, rng, prefixes, 1000, num_clients=3)
    kv = scheduler.kv_cache
    assert worker.num_checked_hits > 100 and scheduler.num_preemptions > 0
    assert kv.num_free_blocks == num_blocks and not scheduler.requests
    assert kv.num_hit_tokens > 0 and kv.num_cached_blocks <= num_blocks


# ---- the engine on the built-in model ------------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer briefly and precisely, and never make things up. " * 3


def _engine(tiny_path, caching: bool, **args) -> LLM:
    return LLM(tiny_path, multiprocess=False, enable_prefix_caching=caching, **args)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_kv_blocks=512, max_num_batched_tokens=48),  # chunked prefill
        dict(num_kv_blocks=14, max_num_batched_tokens=256),  # preemption
        dict(num_kv_blocks=512, num_scheduler_steps=4),  # multi-step
    ],
    ids=["chunked", "preemption", "multi-step"],
)
def test_a_warm_cache_gives_what_the_cache_off_gives(tiny_path, engine_args):
    prompts = [SYSTEM + p for p in PROMPTS[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    with _engine(tiny_path, False, **engine_args) as cold:
        expected = cold.generate(prompts, params, use_tqdm=False)
    with _engine(tiny_path, True, **engine_args) as warm:
        warm.generate(prompts[:1], params, use_tqdm=False)  # the system prompt is in the cache
        got = warm.generate(prompts, params, use_tqdm=False)
        stats = warm.get_engine_stats()
        assert stats.prefix_cache_hits > 0 and free_blocks_are_all(warm)
        assert stats.num_preemptions > 0 or engine_args["num_kv_blocks"] > 14
    assert sum(o.num_cached_tokens for o in got) > 0
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert_same_positions(g.outputs[0].logprobs, e.outputs[0].logprobs, fp32_tolerance=1e-5)


def test_prompt_logprobs_after_the_prompt_was_cached_are_those_of_a_cold_run(tiny_path):
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5)
    with _engine(tiny_path, True, num_kv_blocks=256) as llm:
        cold = llm.generate(SYSTEM, params, use_tqdm=False)[0]
        warm = llm.generate(SYSTEM, params, use_tqdm=False)[0]
        assert warm.num_cached_tokens > 0  # with the rows the cold run kept (tests/test_prompt_rows.py)
        assert llm.generate(SYSTEM, SamplingParams(max_tokens=1), use_tqdm=False)[0].num_cached_tokens > 0
    assert warm.prompt_logprobs == cold.prompt_logprobs  # Logprob equality: bit for bit


def test_n_completions_share_the_prompts_blocks_and_equal_their_single_runs(tiny_path):
    prompt = SYSTEM * 2
    params = SamplingParams(n=8, temperature=1.0, seed=11, max_tokens=6, logprobs=2)
    with _engine(tiny_path, True, num_kv_blocks=512) as llm:
        num_prompt = len(llm.get_tokenizer()(prompt).input_ids)
        before = llm.get_engine_stats().num_prefill_tokens
        together = llm.generate(prompt, params, use_tqdm=False)[0]
        prefill = llm.get_engine_stats().num_prefill_tokens - before
    assert prefill <= num_prompt + 7 * 16  # one prefill; each other completion computes its last block
    assert together.num_cached_tokens >= num_prompt - 16
    with _engine(tiny_path, False, num_kv_blocks=512) as llm:
        for i, completion in enumerate(together.outputs):
            alone = llm.generate(
                prompt, SamplingParams(seed=11 + i, max_tokens=6, logprobs=2), use_tqdm=False
            )
            assert completion.token_ids == alone[0].outputs[0].token_ids


# ---- cache salts (vLLM's cache_salt) -------------------------------------------------------------------


def test_salted_chains_meet_only_their_own_salt():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    tokens = list(range(10))
    kv.allocate("a", 10)
    kv.cache_full_blocks("a", tokens, [], 10, salt="tenant-a")
    assert kv.take_cached_prefix("b", tokens, 9, salt="tenant-a") == 8
    assert kv.take_cached_prefix("c", tokens, 9) == 0  # unsalted
    assert kv.take_cached_prefix("d", tokens, 9, salt="tenant-b") == 0
    kv.allocate("e", 10)
    kv.cache_full_blocks("e", tokens, [], 10)  # the same tokens unsalted: a chain of their own
    assert kv.take_cached_prefix("f", tokens, 9) == 8 and kv.blocks_of("f") != kv.blocks_of("b")


def test_long_rope_chains_meet_only_chains_of_the_same_long_rope_factors():
    """LongRoPE's long factors rotate the same tokens' keys otherwise: such a request's chain starts from
    a root of its own (its salt's too), so neither rotation reads the other's blocks."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    tokens = list(range(10))
    kv.allocate("short", 10)
    kv.cache_full_blocks("short", tokens, [], 10)
    assert kv.take_cached_prefix("a", tokens, 9, is_long_rope=True) == 0
    kv.allocate("long", 10)
    kv.cache_full_blocks("long", tokens, [], 10, salt="tenant", is_long_rope=True)
    assert kv.take_cached_prefix("b", tokens, 9, salt="tenant") == 0
    assert kv.take_cached_prefix("c", tokens, 9, salt="tenant", is_long_rope=True) == 8
    assert kv.take_cached_prefix("d", tokens, 9) == 8 and kv.blocks_of("d") != kv.blocks_of("c")


def test_a_prompts_cache_salt_keeps_its_prefix_to_requests_of_that_salt(tiny_path):
    prompt = (SYSTEM * 2)[:600]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
    with _engine(tiny_path, True, num_kv_blocks=256) as llm:
        first = llm.generate({"prompt": prompt, "cache_salt": "tenant-a"}, greedy, use_tqdm=False)[0]
        same = llm.generate({"prompt": prompt, "cache_salt": "tenant-a"}, greedy, use_tqdm=False)[0]
        other = llm.generate({"prompt": prompt, "cache_salt": "tenant-b"}, greedy, use_tqdm=False)[0]
        unsalted = llm.generate(prompt, greedy, use_tqdm=False)[0]
        with pytest.raises(ValueError, match="multi_modal_data"):
            llm.generate({"prompt": prompt, "multi_modal_data": {}}, greedy, use_tqdm=False)
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt": prompt, "cache_salt": 7}, greedy, use_tqdm=False)
    assert first.num_cached_tokens == 0 and same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    for out in (same, other, unsalted):  # the salt changes what is read, never the numbers
        assert out.outputs[0].logprobs == first.outputs[0].logprobs
