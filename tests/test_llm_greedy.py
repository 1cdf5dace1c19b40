"""Greedy generation against Hugging Face transformers, through chunked prefill and preemption."""

from __future__ import annotations

import pytest
from conftest import HF_TOLERANCE, PROMPTS, free_blocks_are_all, hf_logprobs, load_hf

from coreserve import LLM, SamplingParams

TOLERANCE = HF_TOLERANCE  # 1e-4 with fp32 weights; conftest states the bf16 one


def assert_greedy_matches_hf(hf_model, outputs) -> None:
    """Teacher-forced: each generated token must be HF's argmax at that position, within TOLERANCE,
    so an exact fp32 tie between two candidates cannot make the test flaky."""
    for output in outputs:
        prompt, generated = output.prompt_token_ids, output.outputs[0].token_ids
        logprobs = hf_logprobs(hf_model, prompt + generated)
        for step, token_id in enumerate(generated):
            row = logprobs[len(prompt) - 1 + step]
            assert row[token_id] >= row.max() - TOLERANCE, (output.prompt, step, token_id, int(row.argmax()))


@pytest.mark.parametrize("model_fixture, multiprocess", [("tiny_path", True), ("qwen_path", False)])
def test_greedy_matches_hf_under_chunked_prefill_and_preemption(model_fixture, multiprocess, request):
    path = request.getfixturevalue(model_fixture)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # 16-token chunks force chunked prefill; 20 blocks of 16 tokens cannot hold 17 sequences of ~45 tokens.
    config = dict(max_num_batched_tokens=16, num_kv_blocks=20, block_size=16)
    with LLM(path, multiprocess=multiprocess, **config) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_engine_stats()  # across the socket for the spawned core
        assert stats.num_preemptions > 0 and stats.num_kv_blocks == 20
        assert free_blocks_are_all(llm)
    assert [o.prompt for o in outputs] == PROMPTS
    assert all(len(o.outputs[0].token_ids) == 32 for o in outputs)
    assert_greedy_matches_hf(load_hf(path), outputs)


def test_in_process_and_multiprocess_give_identical_outputs(llm_inproc, llm_mp):
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=12, prompt_logprobs=2),
    ] * 3
    prompts = PROMPTS[: len(params)]
    a = llm_inproc.generate(prompts, params, use_tqdm=False)
    b = llm_mp.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].logprobs == y.outputs[0].logprobs
        assert x.prompt_logprobs == y.prompt_logprobs


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm_inproc):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    alone = llm_inproc.generate([PROMPTS[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batch = llm_inproc.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others, seeded, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm_inproc.generate([PROMPTS[1]] * 2, others, use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_completions_differ_and_each_has_its_own_logprobs(llm_inproc):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, logprobs=1, prompt_logprobs=1)
    (output,) = llm_inproc.generate(PROMPTS[0], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    for completion in output.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        chosen = [next(iter(d.values())).logprob for d in completion.logprobs]
        assert completion.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)


def test_token_id_prompts_and_text_prompts_agree(llm_inproc, tokenizer):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    by_text = llm_inproc.generate(PROMPTS[2], params, use_tqdm=False)[0]
    by_ids = llm_inproc.generate([tokenizer(PROMPTS[2]).input_ids], params, use_tqdm=False)[0]
    assert by_ids.prompt is None
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == tokenizer.decode(by_text.outputs[0].token_ids)
