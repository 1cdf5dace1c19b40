"""The scheduler with no model and no sockets: hand-built runner outputs."""

from __future__ import annotations

import numpy as np

from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.request import Request
from coreserve.engine_core.scheduler import Scheduler
from coreserve.protocol.config import SpeculativeConfig
from coreserve.protocol.messages import FinishReason
from coreserve.protocol.sampling_params import SamplingParams
from coreserve.protocol.step import HostLogprobs, ModelRunnerOutput, SchedulerOutput


def make_request(req_id: str, num_prompt: int, client: bytes = b"c", **params) -> Request:
    sampling = SamplingParams(**{"max_tokens": 4, **params})
    return Request(
        req_id=req_id, client_id=client, client_req_id=req_id, prompt_token_ids=list(range(1, num_prompt + 1)),
        params=sampling, arrival_time=0.0, eos_token_ids=[0], logprobs_mode="raw",
    )


def make_scheduler(num_blocks=16, block_size=4, budget=32, max_num_seqs=8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), max_num_seqs, budget, max_model_len=64)


def runner_output(out: SchedulerOutput, scheduler: Scheduler, token_id: int = 7, k: int | None = None):
    """Samples `token_id` for every request whose scheduled tokens reach its end."""
    sampled = [
        rid
        for rid, n in out.num_scheduled_tokens.items()
        if rid in scheduler.requests
        and scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens
    ]
    result = ModelRunnerOutput(sampled, np.full((len(sampled), 1), token_id, dtype=np.int32))
    if k is not None:
        result.logprob_req_ids = sampled
        ids = np.tile(np.arange(k + 1, dtype=np.int32), (len(sampled), 1))
        result.logprobs = [HostLogprobs(ids, -ids.astype(np.float32), np.ones(len(sampled), dtype=np.int32))]
    return result


def test_chunks_a_long_prompt_under_the_token_budget():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(make_request("a", 20))
    chunks = []
    for _ in range(3):
        out = scheduler.schedule()
        chunks.append(out.num_scheduled_tokens["a"])
        outputs = scheduler.update_from_output(out, runner_output(out, scheduler))
    assert chunks == [8, 8, 4]
    assert outputs[b"c"].outputs[0].new_token_ids == [7]  # only the last chunk samples


def test_new_requests_join_running_ones_each_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, scheduler))
    scheduler.add_request(make_request("b", 4))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    assert [r.req_id for r in out.new_reqs] == ["b"] and [r.req_id for r in out.cached_reqs] == ["a"]


def test_respects_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 2))
    assert list(scheduler.schedule().num_scheduled_tokens) == ["a", "b"]


def test_preempts_newest_request_when_out_of_blocks():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64)
    scheduler.add_request(make_request("old", 8, max_tokens=20))
    scheduler.add_request(make_request("new", 8, max_tokens=20))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, scheduler))  # both at 9 tokens: 3 blocks each needed
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["old"]
    assert "new" in out.finished_req_ids and scheduler.num_preemptions == 1
    assert scheduler.requests["new"].num_computed_tokens == 0
    assert scheduler.waiting[0].req_id == "new"


def test_finishes_on_max_tokens_and_frees_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=2))
    reasons = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, runner_output(out, scheduler))[b"c"].outputs:
            reasons.append(o.finish_reason)
    assert reasons == [None, FinishReason.LENGTH]
    assert scheduler.kv_cache.num_free_blocks == 16


def test_eos_respects_min_tokens_and_ignore_eos():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=5, min_tokens=2))
    scheduler.add_request(make_request("b", 3, max_tokens=2, ignore_eos=True))
    num_tokens, reasons = {"a": 0, "b": 0}, {}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for o in scheduler.update_from_output(out, runner_output(out, scheduler, token_id=0))[b"c"].outputs:
            num_tokens[o.req_id] += len(o.new_token_ids)
            reasons[o.req_id] = o.finish_reason
    assert num_tokens == {"a": 2, "b": 2}
    assert reasons == {"a": FinishReason.STOP, "b": FinishReason.LENGTH}


def test_logprob_rows_are_trimmed_to_each_requests_k():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, logprobs=1))
    scheduler.add_request(make_request("b", 3, logprobs=4))
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, runner_output(out, scheduler, k=4))[b"c"].outputs
    widths = {o.req_id: o.new_logprobs.token_ids_np().shape for o in outputs}
    assert widths == {"a": (1, 2), "b": (1, 5)}


def test_abort_frees_blocks_and_tells_the_worker():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6))
    scheduler.schedule()
    scheduler.abort_requests(["a", "b", "unknown"])
    assert scheduler.kv_cache.num_free_blocks == 16
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == {"a", "b"}


def run_to_the_end(scheduler: Scheduler) -> list[int]:
    """Drives the scheduler with a runner that samples token 7 for every row of every step (windows
    included) until nothing is left; returns each pass's num_steps."""
    passes = []
    while scheduler.requests:
        out = scheduler.schedule()
        passes.append(out.num_steps)
        if out.num_steps == 1:
            result = runner_output(out, scheduler)
        else:
            rows = list(out.num_scheduled_tokens)
            result = ModelRunnerOutput(rows, np.full((len(rows), out.num_steps), 7, dtype=np.int32))
        scheduler.update_from_output(out, result)
    return passes


def test_a_window_is_no_longer_than_its_batch_needs_and_never_costs_a_preemption():
    """Two requests that just fit six 16-token blocks: a window must not reserve blocks past what
    the batch can use and push the other request out (found in review: N=8 preempted, N=1 did not)."""
    preemptions, all_passes = {}, {}
    for num_steps in (1, 8):
        scheduler = Scheduler(
            KVCacheManager(6, 16), 8, 2048, max_model_len=2048, num_scheduler_steps=num_steps
        )
        for req_id, num_prompt in (("a", 12), ("b", 31)):
            scheduler.add_request(make_request(req_id, num_prompt, max_tokens=20, ignore_eos=True))
        all_passes[num_steps] = run_to_the_end(scheduler)
        preemptions[num_steps] = scheduler.num_preemptions
        assert scheduler.kv_cache.num_free_blocks == 6
    assert preemptions == {1: 0, 8: 0}
    assert 8 in all_passes[8] and sum(all_passes[8]) < 21  # windows ran; no step past the last token


def test_a_window_shrinks_to_the_tokens_left():
    scheduler = Scheduler(KVCacheManager(16, 4), 8, 64, max_model_len=64, num_scheduler_steps=8)
    scheduler.add_request(make_request("a", 4, max_tokens=4, ignore_eos=True))
    assert run_to_the_end(scheduler) == [1, 3]  # prefill samples 1, then one window of the 3 left


def test_a_window_that_does_not_fit_is_halved_not_half_reserved():
    """Four 4-token blocks for two requests: the first window (8 steps) needs more blocks than are
    free, so it shrinks to 4, with every request's blocks taken or none; no more preemptions than
    single steps cause, and every block free at the end."""
    preemptions = {}
    for num_steps in (1, 8):
        scheduler = Scheduler(KVCacheManager(4, 4), 8, 256, max_model_len=256, num_scheduler_steps=num_steps)
        for req_id in ("a", "b"):
            scheduler.add_request(make_request(req_id, 3, max_tokens=12, ignore_eos=True))
        passes = run_to_the_end(scheduler)
        preemptions[num_steps] = scheduler.num_preemptions
        assert scheduler.kv_cache.num_free_blocks == 4
    assert passes[:2] == [1, 4]  # prefill, then a window of 8 halved to 4
    assert preemptions[8] <= preemptions[1]


def test_a_window_stops_at_the_models_length():
    scheduler = Scheduler(KVCacheManager(16, 4), 8, 64, max_model_len=20, num_scheduler_steps=8)
    scheduler.add_request(make_request("a", 10, max_tokens=None, ignore_eos=True))
    assert run_to_the_end(scheduler) == [1, 8, 1]  # 11 tokens, 19, then the 20th alone: no wasted step


def test_admits_waiting_requests_round_robin_across_clients_fcfs_within_one():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=3)
    for i in range(100):  # one client's large batch first ...
        scheduler.add_request(make_request(f"big-{i}", 2, client=b"A"))
    scheduler.add_request(make_request("single", 2, client=b"B"))  # ... then another client's one request
    assert list(scheduler.schedule().num_scheduled_tokens) == ["big-0", "single", "big-1"]
    assert len(scheduler.waiting) == 98


def test_an_aborted_waiting_request_is_skipped_and_counted_out():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=2)
    for name in "abcd":
        scheduler.add_request(make_request(name, 2))
    scheduler.abort_requests(["a", "c"])
    assert len(scheduler.waiting) == 2
    assert list(scheduler.schedule().num_scheduled_tokens) == ["b", "d"]
    assert not scheduler.waiting


def test_long_rope_is_chosen_per_request_and_one_outgrowing_the_switch_starts_again_on_the_long_factors():
    """LongRoPE's switch at 8 tokens: a 10-token prompt takes the long factors from its admission, a
    6-token one the short until it holds 9 tokens; then it is computed again from its first token on
    the long ones (the worker drops its state and takes it anew), not counted as a preemption."""
    scheduler = Scheduler(KVCacheManager(16, 4), 8, 32, max_model_len=64, long_rope_switch=8)
    scheduler.add_request(make_request("long", 10, max_tokens=8))
    scheduler.add_request(make_request("short", 6, max_tokens=8))
    out = scheduler.schedule()
    assert {data.req_id: data.is_long_rope for data in out.new_reqs} == {"long": True, "short": False}
    for _ in range(3):  # the short request holds 7, 8, then 9 tokens (the last sampled from 8)
        scheduler.update_from_output(out, runner_output(out, scheduler))
        out = scheduler.schedule()
        if out.new_reqs:
            break
    assert [(d.req_id, d.is_long_rope, d.num_computed_tokens, len(d.token_ids)) for d in out.new_reqs] == [
        ("short", True, 0, 9)
    ]
    assert "short" in out.finished_req_ids and out.num_scheduled_tokens == {"long": 1, "short": 9}
    assert [d.req_id for d in out.cached_reqs] == ["long"] and scheduler.num_preemptions == 0


def test_a_window_stops_where_a_request_on_the_short_long_rope_factors_reaches_the_switch():
    """Windows of 8 steps, LongRoPE's switch at 8: a 5-token request's window stops at 9 tokens (the
    last sampled from 8), it is computed again on the long factors, then its windows run on."""
    scheduler = Scheduler(
        KVCacheManager(16, 4), 8, 64, max_model_len=64, num_scheduler_steps=8, long_rope_switch=8
    )
    scheduler.add_request(make_request("a", 4, max_tokens=12, ignore_eos=True))
    assert run_to_the_end(scheduler) == [1, 4, 1, 6]


def test_proposals_stop_where_a_request_on_the_short_long_rope_factors_reaches_the_switch():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    scheduler = Scheduler(KVCacheManager(16, 4), 8, 64, max_model_len=64, speculative=config, long_rope_switch=8)
    scheduler.add_request(make_request("a", 6, max_tokens=12, ignore_eos=True))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, scheduler))
    assert scheduler.schedule().spec_tokens == {"a": 1}  # 7 tokens: its proposal's row is the 8th's
