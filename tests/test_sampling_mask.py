"""Sampling replay (`SamplingParams(return_sampling_mask=True)`): each generated token's support, the ids
the sampler drew from. Checked against the processed logprobs' -inf pattern over the whole vocabulary
for top-k, top-p and min-p; the drawn token is in it; greedy tokens are their own support; multi-step
windows give the same supports; the server returns them per choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coreserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]
TRUNCATIONS = [dict(top_k=20), dict(top_p=0.8), dict(min_p=0.05), dict(top_k=50, top_p=0.9, min_p=0.01)]


@pytest.fixture(scope="module")
def llm(tiny_path):
    with LLM(tiny_path, multiprocess=False, max_logprobs=-1) as llm:
        yield llm


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=lambda t: ",".join(t))
def test_the_support_is_the_processed_distributions_finite_set(llm, truncation):
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=8, ignore_eos=True, logprobs=-1,
                            logprobs_mode="processed_logprobs", return_sampling_mask=True, **truncation)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = out.outputs[0]
        mask = completion.sampling_mask
        assert len(mask) == len(completion.token_ids) == 8
        for i, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            finite = sorted(t for t, e in entries.items() if e.logprob != float("-inf"))
            assert mask[i].tolist() == finite and token in mask[i]
            assert list(mask[i]) == sorted(mask[i])


def test_the_support_is_what_top_k_and_top_p_keep_of_the_raw_distribution(llm):
    """Checked against the raw logprobs, apart from the processed tensor the mask is cut from: top-k
    keeps the k most likely tokens; top-p the most likely tokens until their mass (at the temperature)
    reaches p, and no fewer."""
    base = dict(temperature=0.9, seed=1, max_tokens=6, ignore_eos=True, logprobs=-1,
                logprobs_mode="raw_logprobs", return_sampling_mask=True)
    for truncation in (dict(top_k=20), dict(top_p=0.8)):
        for out in llm.generate(PROMPTS[:3], SamplingParams(**base, **truncation), use_tqdm=False):
            completion = out.outputs[0]
            for i, entries in enumerate(completion.logprobs):
                ranked = sorted(entries, key=lambda t: -entries[t].logprob)
                kept = completion.sampling_mask[i].tolist()
                assert sorted(ranked[: len(kept)]) == kept  # the most likely tokens, no other
                if "top_k" in truncation:
                    assert len(kept) == 20
                    continue
                probs = torch.softmax(torch.tensor([entries[t].logprob for t in ranked], dtype=torch.float64) / 0.9, 0)
                mass = probs[: len(kept)].sum().item()
                assert mass >= 0.8 - 1e-4 and mass - probs[len(kept) - 1].item() < 0.8 + 1e-4


def test_greedy_tokens_are_their_own_support_and_windows_agree(llm, tiny_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, return_sampling_mask=True)
    out = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0]
    assert [m.tolist() for m in (out.sampling_mask[i] for i in range(6))] == [[t] for t in out.token_ids]
    sampled = SamplingParams(temperature=0.8, top_k=30, seed=4, max_tokens=12, ignore_eos=True,
                             return_sampling_mask=True)
    plain = llm.generate(PROMPTS, sampled, use_tqdm=False)
    with LLM(tiny_path, multiprocess=False, num_scheduler_steps=4) as windows:
        windowed = windows.generate(PROMPTS, sampled, use_tqdm=False)
    for a, b in zip(plain, windowed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert np.array_equal(a.outputs[0].sampling_mask.token_ids, b.outputs[0].sampling_mask.token_ids)
        assert np.array_equal(a.outputs[0].sampling_mask.offsets, b.outputs[0].sampling_mask.offsets)


def test_without_a_truncation_it_is_refused_by_name():
    with pytest.raises(ValueError, match="return_sampling_mask"):
        SamplingParams(temperature=1.0, return_sampling_mask=True)


def test_the_server_returns_each_choices_sampling_mask(llm):
    import openai
    from server_harness import running_server

    body = dict(prompt=PROMPTS[0], max_tokens=5, temperature=0.7, seed=9)
    params = SamplingParams(max_tokens=5, temperature=0.7, seed=9, top_k=10, return_sampling_mask=True)
    expected = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    mask = expected.outputs[0].sampling_mask
    with running_server() as (base, _), openai.OpenAI(base_url=base + "/v1", api_key="none") as client:
        choice = client.completions.create(model="builtin:tiny", extra_body={"return_sampling_mask": True, "top_k": 10}, **body)
        assert choice.choices[0].model_extra["sampling_mask"] == [mask[i].tolist() for i in range(len(mask))]
        streamed = client.completions.create(model="builtin:tiny", stream=True,
                                             extra_body={"return_sampling_mask": True, "top_k": 10}, **body)
        rows = [row for chunk in streamed for row in (chunk.choices[0].model_extra.get("sampling_mask") or [])]
        assert rows == [mask[i].tolist() for i in range(len(mask))]
