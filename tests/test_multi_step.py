"""Multi-step scheduling: N decode steps per scheduler pass give the same outputs as N = 1."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import (
    BATCH_SHAPE_TOLERANCE,
    PROMPTS,
    assert_same_positions,
    copy_model_with_eos,
    free_blocks_are_all,
    stream_then_abort,
)

from coreserve import LLM, AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def reference_run(llm_inproc):
    """Stops chosen from an N = 1 run, so that requests stop at different points inside a window."""
    base = llm_inproc.generate(
        PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    stop_id = base[0].outputs[0].token_ids[11]  # EOS-like: a stop token id mid-window (prefill samples 0)
    text = base[1].outputs[0].text
    stop_string = text[len(text) // 3 : len(text) // 3 + 4]
    return stop_id, stop_string


def workload(stop_id: int, stop_string: str) -> tuple[list[str], list[SamplingParams]]:
    greedy = dict(temperature=0.0, logprobs=5)
    sampled = dict(temperature=0.9, top_p=0.95, seed=17, logprobs=5)
    params = [
        SamplingParams(max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True, **greedy),
        SamplingParams(max_tokens=30, stop=[stop_string], ignore_eos=True, **greedy),
        SamplingParams(max_tokens=14, ignore_eos=True, **greedy),  # 1 + 13: ends inside a window of 4 or 8
        SamplingParams(
            max_tokens=21, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5, **sampled
        ),
        SamplingParams(max_tokens=19, min_tokens=5, ignore_eos=False, **sampled),
        SamplingParams(max_tokens=3, **greedy),
    ]
    return PROMPTS[: len(params)], params


def summary(outputs) -> list[tuple]:
    """Everything exact but the logprob positions, which are compared apart (see assert_same)."""
    rows = []
    for output in outputs:
        c = output.outputs[0]
        rows.append(((c.token_ids, c.text, c.finish_reason, c.stop_reason), c.logprobs, c.cumulative_logprob))
    return rows


def assert_same(got: list[tuple], expected: list[tuple]) -> None:
    """Tokens, text, reasons identical; logprob ids and ranks identical and values equal to fp32
    round-off (a window keeps stopped rows in the batch until it ends, and other matrix shapes round
    differently), or within the bf16 batch-shape tolerance (conftest.assert_same_positions)."""
    for (exact, positions, cumulative), (exact_ref, positions_ref, cumulative_ref) in zip(
        got, expected, strict=True
    ):
        assert exact == exact_ref
        assert_same_positions(positions, positions_ref, fp32_tolerance=1e-4)
        # a sum of len(token_ids) values, each within 1e-4: on an AVX2 CPU (AMD EPYC) the torch path's
        # products round differently by batch shape, and one such sum differed by 1.3e-4
        tolerance = BATCH_SHAPE_TOLERANCE or 1e-4
        assert cumulative == pytest.approx(cumulative_ref, abs=tolerance * len(exact[0]))


@pytest.mark.parametrize("num_steps", [4, 8])
@pytest.mark.parametrize("multiprocess", [False, True])
def test_multi_step_outputs_equal_single_step(tiny_path, llm_inproc, reference_run, num_steps, multiprocess):
    prompts, params = workload(*reference_run)
    expected = summary(llm_inproc.generate(prompts, params, use_tqdm=False))
    with LLM(tiny_path, multiprocess=multiprocess, num_scheduler_steps=num_steps, num_kv_blocks=512) as llm:
        got = summary(llm.generate(prompts, params, use_tqdm=False))
        assert free_blocks_are_all(llm)  # across the socket too: the core's heartbeat reports them
    assert_same(got, expected)
    assert expected[0][0][2:4] == ("stop", reference_run[0]) and expected[1][0][3] == reference_run[1]
    assert len(expected[2][0][0]) == 14 and len(expected[5][0][0]) == 3


def test_windows_on_the_torch_path_equal_single_step(tiny_path, reference_run):
    """Without the CPU kernels (the CUDA path) a window derives each step's slots, context lengths and
    attention gather from the step before, on the device. Against the torch path with N = 1: with bf16
    weights the torch path's activations are bf16 and the kernels' fp32, so llm_inproc differs."""
    prompts, params = workload(*reference_run)
    with LLM(tiny_path, multiprocess=False, num_kv_blocks=512, can_use_cpu_kernels=False) as llm:
        expected = summary(llm.generate(prompts, params, use_tqdm=False))
    with LLM(
        tiny_path, multiprocess=False, num_scheduler_steps=8, num_kv_blocks=512, can_use_cpu_kernels=False
    ) as llm:
        assert llm.client.core.executor.backend.name == "torch"
        got = summary(llm.generate(prompts, params, use_tqdm=False))
        assert free_blocks_are_all(llm)
    assert_same(got, expected)


def record_num_steps(llm) -> list[int]:
    """The num_steps of every pass of an in-process core's scheduler, from now on."""
    scheduler, steps = llm.client.core.scheduler, []
    original = scheduler.schedule

    def recording_schedule():
        out = original()
        steps.append(out.num_steps)
        return out

    scheduler.schedule = recording_schedule
    return steps


def test_windows_actually_run_and_nothing_passes_a_stop(tiny_path, reference_run):
    prompts, params = workload(*reference_run)
    with LLM(tiny_path, multiprocess=False, num_scheduler_steps=8, num_kv_blocks=512) as llm:
        steps = record_num_steps(llm)
        model_steps, fused_forwards = [], []
        runner = llm.client.core.executor
        runner.on_progress = lambda: model_steps.append(1)  # what the server hears
        fused_run = runner.backend.fused.run
        runner.backend.fused.run = lambda *args: fused_forwards.append(1) or fused_run(*args)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert free_blocks_are_all(llm)
        num_layers = runner.model.args.num_layers
    assert 8 in steps and steps[0] == 1  # prefill single, decode in windows
    assert 0 < len(fused_forwards) < sum(steps)  # few-row decode steps in one C call, prefill op by op
    # Every decoder layer of a model step reports progress (a fused forward once, after all of
    # them), and each step of a window once more.
    num_layer_reports = num_layers * (sum(steps) - len(fused_forwards)) + len(fused_forwards)
    assert len(model_steps) == num_layer_reports + sum(n for n in steps if n > 1)
    first = outputs[0].outputs[0]
    assert first.token_ids[-1] == reference_run[0] and reference_run[0] not in first.token_ids[:-1]
    assert all(len(o.outputs[0].token_ids) <= p.max_tokens for o, p in zip(outputs, params))


def test_min_tokens_and_a_real_eos_inside_windows(tiny_path, llm_inproc, tmp_path):
    """EOS set to a token greedy decoding emits early: min_tokens must ban it (and a stop token id)
    step by step inside a window, then let it stop the request, exactly as with N = 1."""
    base = (
        llm_inproc.generate(
            PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    eos, stop_id = base[2], base[4]
    path = copy_model_with_eos(tiny_path, tmp_path / "eos", eos)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, logprobs=5),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, stop_token_ids=[stop_id], logprobs=5),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=5),  # stops at its first EOS
    ]
    results = {}
    for num_steps in (1, 8):
        with LLM(path, multiprocess=False, num_scheduler_steps=num_steps, num_kv_blocks=128) as llm:
            results[num_steps] = summary(llm.generate([PROMPTS[0]] * 3, params, use_tqdm=False))
            assert free_blocks_are_all(llm)
    assert_same(results[8], results[1])
    banned_then_stopped = [row[0][0] for row in results[1]]
    assert banned_then_stopped[2] == base[:3]  # EOS at index 2 without min_tokens
    for token_ids in banned_then_stopped[:2]:
        assert len(token_ids) >= 6 and eos not in token_ids[:6] and stop_id not in token_ids[:6]


def test_n_completions_and_prompt_logprobs_under_windows(tiny_path, llm_inproc):
    """n = 2 seeded completions (seed + i each) and prompt logprobs: the prefill runs single, the
    completions decode in windows, and everything equals N = 1."""
    params = SamplingParams(
        n=2, temperature=0.8, seed=5, max_tokens=18, logprobs=3, prompt_logprobs=3, ignore_eos=True
    )
    expected = llm_inproc.generate(PROMPTS[:2], params, use_tqdm=False)
    with LLM(tiny_path, multiprocess=False, num_scheduler_steps=8, num_kv_blocks=256) as llm:
        steps = record_num_steps(llm)
        got = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert free_blocks_are_all(llm)
    assert 8 in steps  # the completions did decode in windows
    for output, reference in zip(got, expected, strict=True):
        assert [list(p or {}) for p in output.prompt_logprobs] == [
            list(p or {}) for p in reference.prompt_logprobs
        ]
        assert len(output.outputs) == 2 and output.outputs[0].token_ids != output.outputs[1].token_ids
        for completion, ref in zip(output.outputs, reference.outputs, strict=True):
            assert completion.token_ids == ref.token_ids and completion.text == ref.text
            assert_same_positions(completion.logprobs, ref.logprobs, fp32_tolerance=1e-4)
            tolerance = (BATCH_SHAPE_TOLERANCE or 1e-4) * len(completion.token_ids)
            assert completion.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=tolerance)


def test_streamed_windows_carry_up_to_n_tokens_per_delta(tiny_path, llm_inproc):
    params = SamplingParams(temperature=0.0, max_tokens=23, logprobs=2, stop=[" the"], ignore_eos=True)
    expected = llm_inproc.generate(PROMPTS[5], params, use_tqdm=False)[0].outputs[0]

    async def collect(engine):
        return [out async for out in engine.generate(PROMPTS[5], params, "stream")]

    with AsyncLLM(tiny_path, multiprocess=False, num_scheduler_steps=4, num_kv_blocks=256) as engine:
        deltas = asyncio.run(collect(engine))
    sizes = [len(d.outputs[0].token_ids) for d in deltas]
    assert max(sizes) == 4 and all(n <= 4 for n in sizes)
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == expected.text
    assert [list(lp) for d in deltas for lp in d.outputs[0].logprobs] == [
        list(lp) for lp in expected.logprobs
    ]
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == expected.finish_reason


def test_an_abort_between_windows_ends_the_stream_and_frees_its_blocks(tiny_path):
    params = SamplingParams(temperature=0.0, max_tokens=2000, logprobs=2, ignore_eos=True)
    with AsyncLLM(tiny_path, multiprocess=False, num_scheduler_steps=8, num_kv_blocks=256) as engine:
        outputs = asyncio.run(stream_then_abort(engine, params, "to-abort"))
        core = engine.engine.client.core  # stepped by the engine's thread, which handles the abort
        deadline = time.monotonic() + 2  # 2,000 tokens alone would take the core 8 s or more
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.kv_cache.num_free_blocks == core.num_kv_blocks and not core.has_unfinished_requests()
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    streamed = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert streamed < 2000 and streamed == sum(len(o.outputs[0].logprobs) for o in outputs)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True])
def test_num_scheduler_steps_not_a_positive_integer_is_a_value_error(bad):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(num_scheduler_steps=bad)
