"""`SamplingParams(detokenize=False)`, vLLM's: the same ids and numbers, no text. lm-eval's in-process vLLM
backend scores with exactly `SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1,
detokenize=False)` (lm_eval/models/vllm_causallms.py)."""

from __future__ import annotations

import pytest

from coreserve import SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]


def numbers(output) -> tuple:
    prompt = [None if d is None else [(t, v.logprob, v.rank) for t, v in d.items()] for d in output.prompt_logprobs]
    completion = output.outputs[0]
    sampled = [[(t, v.logprob, v.rank) for t, v in d.items()] for d in completion.logprobs or []]
    return completion.token_ids, prompt, sampled


def test_lm_evals_scoring_params_give_the_same_numbers_without_text(llm_inproc):
    lm_eval = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    with_text = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1)
    quiet, loud = (llm_inproc.generate(PROMPTS, p, use_tqdm=False) for p in (lm_eval, with_text))
    for a, b in zip(quiet, loud):
        assert numbers(a) == numbers(b)
        assert a.outputs[0].text == "" and b.outputs[0].text != ""
        assert all(v.decoded_token is None for d in a.prompt_logprobs[1:] for v in d.values())
        assert all(v.decoded_token is not None for d in b.prompt_logprobs[1:] for v in d.values())


def test_generation_without_text_keeps_ids_and_logprobs(llm_inproc):
    params = dict(temperature=0.8, seed=3, max_tokens=12, logprobs=2, ignore_eos=True)
    quiet = llm_inproc.generate(PROMPTS, SamplingParams(**params, detokenize=False), use_tqdm=False)
    loud = llm_inproc.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)
    for a, b in zip(quiet, loud):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == ""
        assert [[(t, v.logprob) for t, v in d.items()] for d in a.outputs[0].logprobs] == [
            [(t, v.logprob) for t, v in d.items()] for d in b.outputs[0].logprobs
        ]
        assert all(v.decoded_token is None for d in a.outputs[0].logprobs for v in d.values())


def test_stop_strings_without_text_are_refused_by_name():
    with pytest.raises(ValueError, match="detokenize=False"):
        SamplingParams(stop=["\n"], detokenize=False)
