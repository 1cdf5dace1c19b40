"""A request id is free again the moment its AsyncLLM stream is left (break, aclose, cancel), on the same
event loop, and the old request's outputs never reach the new one: through a spawned core (issue 20)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import PROMPTS

from coreserve import AsyncLLM, SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
ROUNDS = 20


@pytest.fixture(scope="module")
def engine(tiny_path):
    with AsyncLLM(tiny_path, num_kv_blocks=512) as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(llm_inproc):
    """What the short request alone gives: the reused id's stream must give exactly this."""
    return llm_inproc.generate(PROMPTS[1], SHORT, use_tqdm=False)[0]


async def leave_by_break(engine) -> None:
    async for _ in engine.generate(PROMPTS[0], LONG, "reused"):
        break


async def leave_by_aclose(engine) -> None:
    stream = engine.generate(PROMPTS[0], LONG, "reused")
    await stream.__anext__()
    await stream.aclose()


async def leave_by_cancel(engine) -> None:
    async def consume():
        async for _ in engine.generate(PROMPTS[0], LONG, "reused"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def reuse_the_id(engine, leave) -> list:
    """ROUNDS times: start the long request, leave its stream, and at once run the short one under the
    same id to its end. Returns each round's deltas of the short one."""
    rounds = []
    for _ in range(ROUNDS):
        await leave(engine)
        rounds.append([out async for out in engine.generate(PROMPTS[1], SHORT, "reused")])
    return rounds


@pytest.mark.parametrize("leave", [leave_by_break, leave_by_aclose, leave_by_cancel])
def test_a_request_id_is_free_at_once_after_leaving_its_stream(engine, expected, leave):
    async def main():
        rounds = await reuse_the_id(engine, leave)
        return rounds, await engine.get_engine_stats()

    rounds, stats = asyncio.run(main())
    want = expected.outputs[0]
    for deltas in rounds:
        assert all(d.request_id == "reused" for d in deltas)
        assert all(d.prompt_token_ids == expected.prompt_token_ids for d in deltas)
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        assert [t for d in deltas for t in d.outputs[0].token_ids] == want.token_ids
        assert [lp for d in deltas for lp in d.outputs[0].logprobs] == want.logprobs
    assert stats.num_running == stats.num_waiting == 0  # every left stream's request was aborted
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_an_open_stream_still_holds_its_id(engine):
    async def main():
        stream = engine.generate(PROMPTS[0], LONG, "held")
        await stream.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate(PROMPTS[0], SHORT, "held").__anext__()
        await stream.aclose()
        return [out async for out in engine.generate(PROMPTS[1], SHORT, "held")]

    deltas = asyncio.run(main())
    assert deltas[-1].finished and sum(len(d.outputs[0].token_ids) for d in deltas) == 4


def test_a_refused_request_leaves_its_id_free(engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await engine.generate("", SHORT, "refused").__anext__()
        return [out async for out in engine.generate(PROMPTS[1], SHORT, "refused")]

    assert asyncio.run(main())[-1].finished
