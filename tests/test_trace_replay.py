"""Trace replay (`SamplingParams(trace_decode_token_ids=...)`, vLLM's name): the decode follows the given
tokens and each gets the model's own logprob row. A sampled rollout replayed gets its own logprobs and
ranks back bit for bit; forced tokens the model would not pick get their true logprob and rank (those
of scoring the sequence: scoring equals generation)."""

from __future__ import annotations

import random

import pytest

from coreserve import SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]


def rows(completion) -> list:
    return [(t, [(i, e.logprob, e.rank) for i, e in d.items()]) for t, d in zip(completion.token_ids, completion.logprobs)]


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_a_replayed_rollout_gets_its_own_logprobs_and_ranks(llm_inproc, mode):
    rollout = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=16, logprobs=4, ignore_eos=True,
                             logprobs_mode=mode)
    outputs = llm_inproc.generate(PROMPTS, rollout, use_tqdm=False)
    replays = [SamplingParams(temperature=0.9, top_p=0.9, seed=99, max_tokens=16, logprobs=4, ignore_eos=True,
                              logprobs_mode=mode, trace_decode_token_ids=out.outputs[0].token_ids)
               for out in outputs]
    replayed = llm_inproc.generate(PROMPTS[::-1], replays[::-1], use_tqdm=False)[::-1]  # another batch order
    for out, again in zip(outputs, replayed):
        assert rows(again.outputs[0]) == rows(out.outputs[0])


def test_forced_tokens_get_their_true_logprob_and_rank(llm_inproc):
    rng = random.Random(0)
    trace = [rng.randrange(100, 5000) for _ in range(10)]  # tokens greedy decoding would not choose
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True, trace_decode_token_ids=trace)
    out = llm_inproc.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == trace
    scored = llm_inproc.generate([{"prompt_token_ids": out.prompt_token_ids + trace}],
                                 SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    first = len(out.prompt_token_ids)
    for i, (token, entry) in enumerate(zip(trace, out.outputs[0].logprobs)):
        assert entry[token] == scored.prompt_logprobs[first + i][token]
    assert max(entry[token].rank for token, entry in zip(trace, out.outputs[0].logprobs)) > 1


def test_past_the_trace_tokens_are_sampled_and_bad_ids_are_refused(llm_inproc):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, trace_decode_token_ids=[500, 501])
    out = llm_inproc.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    greedy = llm_inproc.generate([{"prompt_token_ids": llm_inproc.generate([PROMPTS[1]], SamplingParams(max_tokens=1),
                                  use_tqdm=False)[0].prompt_token_ids + [500, 501]}],
                                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == [500, 501] + greedy.outputs[0].token_ids
    with pytest.raises(ValueError, match="trace_decode_token_ids"):
        llm_inproc.generate([PROMPTS[0]], SamplingParams(trace_decode_token_ids=[10**9]), use_tqdm=False)
