"""AsyncLLM streaming over a real core process: deltas, cancellation, many concurrent streams."""

from __future__ import annotations

import asyncio

import pytest
from conftest import PROMPTS, stream_then_abort

from coreserve import AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_path):
    with AsyncLLM(tiny_path, num_kv_blocks=2048, max_num_seqs=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def engine_inproc(tiny_path):
    with AsyncLLM(tiny_path, multiprocess=False, num_kv_blocks=512) as engine:
        yield engine


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


@pytest.mark.parametrize("engine_fixture", ["engine", "engine_inproc"])
def test_deltas_concatenate_to_the_non_streamed_output(engine_fixture, request, llm_inproc):
    engine = request.getfixturevalue(engine_fixture)
    params = SamplingParams(
        temperature=0.0, max_tokens=20, logprobs=3, prompt_logprobs=2, stop=[" the"], ignore_eos=True
    )
    deltas = asyncio.run(collect(engine, PROMPTS[5], params, "stream-1"))
    expected = llm_inproc.generate(PROMPTS[5], params, use_tqdm=False)[0]
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    completion = expected.outputs[0]
    assert "".join(d.outputs[0].text for d in deltas) == completion.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == completion.token_ids
    assert [lp for d in deltas for lp in d.outputs[0].logprobs] == completion.logprobs
    assert deltas[-1].outputs[0].finish_reason == completion.finish_reason
    assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(completion.cumulative_logprob)
    assert deltas[0].prompt_logprobs == expected.prompt_logprobs


def test_breaking_out_of_a_stream_aborts_it_and_frees_its_blocks(tiny_path):
    async def main(engine):
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        count = 0
        async for _ in engine.generate(PROMPTS[0], params, "to-cancel"):
            count += 1
            if count == 3:
                break
        task = asyncio.create_task(collect(engine, PROMPTS[1], params, "to-cancel-2"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)

    with AsyncLLM(tiny_path, multiprocess=False, num_kv_blocks=128) as engine:
        asyncio.run(main(engine))
        core = engine.engine.client.core
        assert not core.has_unfinished_requests()
        assert core.kv_cache.num_free_blocks == core.num_kv_blocks


def test_two_hundred_concurrent_streams_all_finish_with_the_right_counts(engine):
    async def main():
        lengths = [5 + i % 17 for i in range(200)]
        tasks = [
            collect(
                engine,
                PROMPTS[i % len(PROMPTS)],
                SamplingParams(max_tokens=n, ignore_eos=True, seed=i),
                f"c{i}",
            )
            for i, n in enumerate(lengths)
        ]
        results = await asyncio.gather(*tasks)
        return lengths, results

    lengths, results = asyncio.run(main())
    for n, deltas in zip(lengths, results):
        assert deltas[-1].finished
        assert sum(len(d.outputs[0].token_ids) for d in deltas) == n


def test_duplicate_request_id_is_a_value_error(engine):
    async def main():
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        first = engine.generate(PROMPTS[0], params, "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate(PROMPTS[0], params, "dup").__anext__()
        await first.aclose()

    asyncio.run(main())


def test_abort_ends_the_stream_with_finish_reason_abort(engine):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    outputs = asyncio.run(stream_then_abort(engine, params, "to-abort"))
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outputs) < 400


def test_shutdown_ends_open_streams_with_engine_dead_error(tiny_path):
    from coreserve import EngineDeadError

    async def main(engine):
        params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)

        async def consume():
            async for _ in engine.generate(PROMPTS[0], params, "open"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(1.0)
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, timeout=10)

    engine = AsyncLLM(tiny_path, multiprocess=False, num_kv_blocks=256)
    asyncio.run(main(engine))


def test_n_greater_than_one_streams_each_finished_completion_once(engine, llm_inproc):
    """A delta of an n > 1 request carries only the completions that changed: a finished one appears
    once, with its finish reason, and never after (issue 20)."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, stop=["e"], ignore_eos=True)
    expected = llm_inproc.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs
    assert len({len(c.token_ids) for c in expected}) > 1  # the completions finish at different tokens
    for attempt in range(5):  # their finishes land in different deltas unless this loop read late
        deltas = asyncio.run(collect(engine, PROMPTS[0], params, f"n3-stream-{attempt}"))
        finished_at = {}
        for step, delta in enumerate(deltas):
            for completion in delta.outputs:
                assert completion.index not in finished_at, f"completion {completion.index} sent after its finish"
                if completion.finish_reason is not None:
                    finished_at[completion.index] = step
        assert sorted(finished_at) == [0, 1, 2]
        if len(set(finished_at.values())) > 1:
            break
    assert len(set(finished_at.values())) > 1, "five runs read every finish in one delta"
    for want in expected:
        pieces = [c for d in deltas for c in d.outputs if c.index == want.index]
        assert "".join(c.text for c in pieces) == want.text
        assert [t for c in pieces for t in c.token_ids] == want.token_ids
        assert pieces[-1].finish_reason == want.finish_reason


def test_an_engine_call_that_fails_fails_its_caller_alone(engine):
    """EngineCall, the engine thread's command for engine-wide calls: an error goes to the caller only."""
    from coreserve.frontend.engine.engine import FrontendEngine

    async def main():
        with pytest.raises(ZeroDivisionError):
            await engine._call(lambda _: 1 / 0)
        stream = collect(engine, PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True), "after-call")
        return await engine._call(FrontendEngine.has_unfinished), await stream

    has_unfinished, deltas = asyncio.run(main())
    assert has_unfinished is False and not engine.is_dead
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 3
