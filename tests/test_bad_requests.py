"""Bad requests fail their own caller with a ValueError, at once, and touch nothing else: mistyped or
mutated SamplingParams, out-of-range numbers, requests the core refuses, errors on the engine thread."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from conftest import PROMPTS, free_blocks_are_all

from coreserve import AsyncLLM, RequestFailedError, SamplingParams

OK = SamplingParams(temperature=0.0, max_tokens=4)

MISTYPED = [
    dict(max_tokens=2.5),
    dict(logprobs=True),
    dict(stop=["a", 5]),
    dict(stop_token_ids=[1.0]),
    dict(ignore_eos="no"),
    dict(logprobs_mode="bogus"),
    dict(n=2.5),
]
OUT_OF_RANGE = [
    dict(seed=2**70),
    dict(seed=2**64 - 2, n=3),
    dict(max_tokens=2**64),
    dict(min_tokens=2**64, max_tokens=None),
    dict(temperature=float("inf")),
    dict(temperature=float("nan")),
    dict(top_p=float("nan")),
    dict(repetition_penalty=1e-300),
    dict(presence_penalty=float("-inf")),
    dict(n=100_000),
]


def _field(kwargs: dict) -> str:
    return next(iter(kwargs))


@pytest.mark.parametrize("kwargs", MISTYPED + OUT_OF_RANGE, ids=str)
def test_a_bad_field_is_a_value_error_naming_it(kwargs):
    with pytest.raises(ValueError, match=_field(kwargs)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", MISTYPED + OUT_OF_RANGE, ids=str)
def test_a_field_changed_after_building_is_caught_before_sending(llm_mp, kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for name, value in kwargs.items():
        setattr(params, name, value)
    started = time.monotonic()
    with pytest.raises(ValueError, match=_field(kwargs)):
        llm_mp.generate([PROMPTS[0], PROMPTS[1]], [OK, params], use_tqdm=False)
    assert time.monotonic() - started < 5
    assert not llm_mp.output_processor.requests  # nothing of the failed call stays behind
    assert llm_mp.generate(PROMPTS[0], OK, use_tqdm=False)[0].finished


def test_a_request_the_core_refuses_fails_alone_with_the_cores_reason(llm_mp):
    """The frontend's view of the limits can differ from the core's (here: patched): the core refuses
    the request with its reason, the other requests of the call finish, and no block is left taken."""
    facts = llm_mp.input_processor.facts
    llm_mp.input_processor.facts = msgspec.structs.replace(facts, max_logprobs=100)
    try:
        with pytest.raises(RequestFailedError, match="logprobs=50 is more than max_logprobs=20"):
            llm_mp.generate(PROMPTS[:3], [OK, SamplingParams(logprobs=50), OK], use_tqdm=False)
    finally:
        llm_mp.input_processor.facts = facts
    assert not llm_mp.output_processor.requests
    assert free_blocks_are_all(llm_mp)


@pytest.fixture(scope="module")
def engine(tiny_path):
    with AsyncLLM(tiny_path, num_kv_blocks=512) as engine:
        yield engine


async def _collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_bad_requests_fail_beside_a_good_stream_that_completes(engine):
    good = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        stream = asyncio.create_task(_collect(engine, PROMPTS[0], good, "good"))
        await asyncio.sleep(0.2)
        for kwargs in MISTYPED + OUT_OF_RANGE:
            params = SamplingParams(max_tokens=4)
            for name, value in kwargs.items():
                setattr(params, name, value)
            with pytest.raises(ValueError, match=_field(kwargs)):
                await _collect(engine, PROMPTS[1], params)
        # Valid when generate() is called, made bad before its first __anext__ submits it: the one check
        # (FrontendEngine.prepare, at submission) refuses it.
        mutated_late = SamplingParams(max_tokens=4)
        agen = engine.generate(PROMPTS[1], mutated_late, "late")
        first = asyncio.ensure_future(agen.__anext__())
        mutated_late.max_tokens = 0
        with pytest.raises(ValueError):
            await first
        return await stream

    deltas = asyncio.run(main())
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 40 and deltas[-1].finished
    assert not engine.is_dead


def test_an_error_handling_one_requests_output_ends_that_request_only(engine):
    """A fault injected into one request's detokenizer (the engine thread's per-output work), once
    its first delta has arrived."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def victim_stream() -> None:
        async for _ in engine.generate(PROMPTS[0], params, "victim"):
            processor = engine.engine.outputs
            for completion in list(processor.completion_of.values()):
                if processor.owner_of[completion.core_req_id].request_id.startswith("victim@"):
                    completion.detokenizer.append = _raise

    async def main():
        other = asyncio.create_task(_collect(engine, PROMPTS[1], params, "other"))
        with pytest.raises(RequestFailedError, match="injected"):
            await victim_stream()
        return await other

    deltas = asyncio.run(main())
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 30
    stats = asyncio.run(engine.get_engine_stats())
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def _raise(*args):
    raise RuntimeError("injected fault")


def test_a_request_id_reused_after_a_cancel_gets_its_own_outputs(engine):
    async def main():
        for _ in range(20):
            agen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=300, ignore_eos=True), "same")
            await agen.__anext__()
            await agen.aclose()  # cancelled after its first delta
            deltas = await _collect(engine, PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True), "same")
            assert deltas[-1].outputs[0].finish_reason == "length"
            assert sum(len(d.outputs[0].token_ids) for d in deltas) == 5
            assert {d.request_id for d in deltas} == {"same"}

    asyncio.run(main())


def test_prompt_logprobs_come_in_the_first_delta_only_and_stats_are_served(engine):
    params = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2, ignore_eos=True)
    deltas = asyncio.run(_collect(engine, PROMPTS[2], params))
    assert len(deltas) > 1 and deltas[0].prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    stats = asyncio.run(engine.get_engine_stats())
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
