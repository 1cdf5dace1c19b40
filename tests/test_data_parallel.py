"""Several daemons behind one LLM: outputs equal a single core's, requests spread over both, and the
death of one fails only its own requests, quickly; the next generate runs on the other."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from conftest import PROMPTS, free_blocks_are_all, start_daemon

from coreserve import LLM, AsyncLLM, EngineDeadError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)


@pytest.fixture
def two_daemons(tiny_path, tmp_path):
    addresses = [f"ipc://{tmp_path}/core{i}" for i in range(2)]
    procs = [start_daemon(tiny_path, a, "--num-kv-blocks", "256", "--log-level", "ERROR") for a in addresses]
    yield addresses, procs
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def test_two_daemons_give_a_single_cores_outputs_and_share_the_work(two_daemons, tiny_path, llm_inproc):
    addresses, _ = two_daemons
    params = [GREEDY, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)] * 3
    expected = llm_inproc.generate(PROMPTS[:6], params, use_tqdm=False)
    with LLM(tiny_path, core_address=addresses) as llm:
        got = llm.generate(PROMPTS[:6], params, use_tqdm=False)
        per_core = [core.get_stats() for core in llm.client.cores]
        assert free_blocks_are_all(llm)
        total = llm.get_engine_stats()
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
    assert all(s.num_prefill_tokens > 0 for s in per_core)  # both cores did work
    assert total.num_kv_blocks == 512 and total.num_prefill_tokens == sum(
        s.num_prefill_tokens for s in per_core
    )


def test_killing_one_daemon_fails_only_its_requests_and_the_other_serves_on(two_daemons, tiny_path):
    addresses, procs = two_daemons
    long_run = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def stream(engine, prompt, params, request_id):
        try:
            return [o async for o in engine.generate(prompt, params, request_id)]
        except EngineDeadError as exc:
            return exc, time.monotonic()

    async def main(engine):
        # Requests alternate over the two idle cores: core0 gets the long ones, core1 the short ones.
        tasks = [
            asyncio.create_task(stream(engine, PROMPTS[i], long_run if i % 2 == 0 else short, f"r{i}"))
            for i in range(4)
        ]
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        return killed_at, await asyncio.gather(*tasks)

    with AsyncLLM(tiny_path, core_address=addresses) as engine:
        killed_at, results = asyncio.run(main(engine))
        for failed in (results[0], results[2]):
            error, failed_at = failed
            assert "core0" in str(error) and failed_at - killed_at < 2.0
        assert [sum(len(o.outputs[0].token_ids) for o in results[i]) for i in (1, 3)] == [40, 40]
    with LLM(tiny_path, core_address=addresses[1]) as llm:  # the survivor serves on
        out = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [8, 8, 8]
        assert free_blocks_are_all(llm)


def test_a_generate_after_a_cores_death_runs_on_the_others(two_daemons, tiny_path):
    addresses, procs = two_daemons
    with LLM(tiny_path, core_address=addresses) as llm:
        procs[0].kill()
        procs[0].wait(timeout=30)
        deadline = time.monotonic() + 5
        while len(llm.client.live) == 2 and time.monotonic() < deadline:
            llm.client.get_outputs(0.1)  # the client notices the closed connection
        out = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [8, 8, 8]
        assert llm.client.live == [llm.client.cores[1]]
