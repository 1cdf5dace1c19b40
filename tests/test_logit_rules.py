"""logit_bias and allowed_token_ids (vLLM's), and the logits modes, on the built-in model against Hugging
Face's logits in fp32: in process and through a spawned core."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HF_TOLERANCE, PROMPTS

from coreserve import SamplingParams

TOL = HF_TOLERANCE
GREEDY = dict(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(params=["llm_inproc", "llm_mp"])
def llm(request):
    return request.getfixturevalue(request.param)


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float64 logits of HF's model at every position."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].double()


def completion_logits(hf_tiny, output) -> torch.Tensor:
    """HF's logits at each generated position of `output`: [num_generated, vocab]."""
    prompt, generated = output.prompt_token_ids, output.outputs[0].token_ids
    return hf_logits(hf_tiny, prompt + generated)[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def assert_entries_match(completion, reference: torch.Tensor) -> None:
    """Every listed value equals the reference row's (-inf where it is -inf); ranks count strictly higher."""
    for step, entry in enumerate(completion.logprobs):
        assert next(iter(entry)) == completion.token_ids[step]
        for token_id, logprob in entry.items():
            expected = reference[step, token_id].item()
            if math.isinf(expected):
                assert logprob.logprob == expected
                continue
            assert logprob.logprob == pytest.approx(expected, abs=TOL)
            low = int((reference[step] > expected + TOL).sum()) + 1
            high = int((reference[step] > expected - TOL).sum()) + 1
            assert low <= logprob.rank <= high


def test_a_bias_of_100_makes_greedy_pick_the_token(llm):
    plain = llm.generate(PROMPTS[1], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    target = 1234
    assert target not in plain  # the bias, not the model, must be what picks it
    params = SamplingParams(**GREEDY, logit_bias={target: 100.0})
    assert llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids == [target] * 5


def test_a_bias_of_minus_100_keeps_the_greedy_token_out(llm):
    plain = llm.generate(PROMPTS[2], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(**GREEDY, logit_bias={plain[0]: -100.0})
    assert llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0].token_ids[0] != plain[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_restrict_every_output_token(llm, temperature):
    allowed = [11, 290, 3290, 7777]
    params = SamplingParams(
        temperature=temperature, seed=5, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed
    )
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    tokens = [t for out in outputs for t in out.outputs[0].token_ids]
    assert len(tokens) == 36 and set(tokens) <= set(allowed)
    plain = llm.generate(PROMPTS[:3], SamplingParams(**GREEDY), use_tqdm=False)
    assert not {t for out in plain for t in out.outputs[0].token_ids} <= set(allowed)


def test_a_batch_mixing_rows_with_and_without_rules_keeps_each_row_its_own(llm):
    plain = SamplingParams(**GREEDY)
    biased = SamplingParams(**GREEDY, logit_bias={4321: 100.0})
    outputs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[0]], [plain, biased, plain], use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == [4321] * 5
    assert outputs[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids != [4321] * 5


def test_processed_logprobs_under_a_bias_are_log_softmax_of_biased_hf_logits(llm, hf_tiny):
    bias = {262: 4.0, 13: -3.0, 1000: 2.5, 50: 7.0}
    params = SamplingParams(**GREEDY, logprobs=5, logit_bias=bias, logprobs_mode="processed_logprobs")
    output = llm.generate(PROMPTS[5], params, use_tqdm=False)[0]
    logits = completion_logits(hf_tiny, output)
    for token_id, value in bias.items():
        logits[:, token_id] += value
    assert output.outputs[0].token_ids == logits.argmax(-1).tolist()
    assert_entries_match(output.outputs[0], torch.log_softmax(logits, dim=-1))


def test_raw_logprobs_under_a_bias_stay_the_models(llm, hf_tiny):
    params = SamplingParams(**GREEDY, logprobs=5, logit_bias={262: 4.0, 50: 7.0})
    output = llm.generate(PROMPTS[5], params, use_tqdm=False)[0]
    assert_entries_match(output.outputs[0], torch.log_softmax(completion_logits(hf_tiny, output), dim=-1))


def test_processed_logprobs_with_allowed_tokens_are_minus_inf_outside_them(llm, hf_tiny):
    allowed = [11, 290, 3290, 7777, 50]
    params = SamplingParams(**GREEDY, logprobs=8, allowed_token_ids=allowed, logprobs_mode="processed")
    output = llm.generate(PROMPTS[6], params, use_tqdm=False)[0]
    logits = completion_logits(hf_tiny, output)
    masked = torch.full_like(logits, float("-inf"))
    masked[:, allowed] = logits[:, allowed]
    reference = torch.log_softmax(masked, dim=-1)
    assert_entries_match(output.outputs[0], reference)
    assert all(
        sum(math.isfinite(lp.logprob) for lp in entry.values()) == 5 for entry in output.outputs[0].logprobs
    )


def test_raw_logits_mode_returns_hf_logits_ranked_as_the_logprobs(llm, hf_tiny):
    params = SamplingParams(**GREEDY, logprobs=5)
    as_logprobs = llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    logits_params = SamplingParams(**GREEDY, logprobs=5, logprobs_mode="raw_logits")
    as_logits = llm.generate(PROMPTS[3], logits_params, use_tqdm=False)[0]
    assert as_logits.outputs[0].token_ids == as_logprobs.outputs[0].token_ids
    logits = completion_logits(hf_tiny, as_logits)
    assert_entries_match(as_logits.outputs[0], logits)
    for entry, reference in zip(as_logits.outputs[0].logprobs, as_logprobs.outputs[0].logprobs):
        assert list(entry) == list(reference)
        assert [lp.rank for lp in entry.values()] == [lp.rank for lp in reference.values()]
    assert as_logits.outputs[0].cumulative_logprob == pytest.approx(
        sum(logits[i, t].item() for i, t in enumerate(as_logits.outputs[0].token_ids)), abs=10 * TOL
    )


def test_processed_logits_mode_returns_the_logits_after_bias_temperature_and_top_k(llm, hf_tiny):
    bias = {262: 4.0, 50: 7.0}
    params = SamplingParams(
        temperature=0.5, top_k=10, seed=3, max_tokens=5, ignore_eos=True, logprobs=12, logit_bias=bias,
        logprobs_mode="processed_logits",
    )
    output = llm.generate(PROMPTS[4], params, use_tqdm=False)[0]
    logits = completion_logits(hf_tiny, output)
    for token_id, value in bias.items():
        logits[:, token_id] += value
    logits /= 0.5
    kth = logits.topk(10, dim=-1).values[:, -1:]
    reference = logits.masked_fill(logits < kth, float("-inf"))
    assert_entries_match(output.outputs[0], reference)
    assert all(
        sum(math.isinf(lp.logprob) for lp in entry.values()) >= 2 for entry in output.outputs[0].logprobs
    )


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_the_core_refuses_out_of_vocabulary_rule_ids_it_was_sent(llm_mp, field):
    """A client whose view of the vocabulary is wrong (here: patched) cannot put a bad id on the model:
    the core refuses that request alone, naming the field and the vocabulary size."""
    import msgspec
    from conftest import free_blocks_are_all

    from coreserve import RequestFailedError

    bad = SamplingParams(**GREEDY, **{field: {60000: 1.0} if field == "logit_bias" else [60000]})
    facts = llm_mp.input_processor.facts
    llm_mp.input_processor.facts = msgspec.structs.replace(facts, vocab_size=70000)
    try:
        with pytest.raises(RequestFailedError, match=rf"{field} must be token ids in \[0, 50257\)"):
            llm_mp.generate(PROMPTS[:2], [SamplingParams(**GREEDY), bad], use_tqdm=False)
    finally:
        llm_mp.input_processor.facts = facts
    assert free_blocks_are_all(llm_mp)


def test_a_batch_without_rules_builds_none_and_samples_from_the_logits_themselves():
    """No per-step cost for rows without rules: no tensors built, and greedy rows get no logits copy."""
    from coreserve.worker.sampling.logprobs import TorchSamplingOps
    from coreserve.worker.sampling.metadata import build_sampling_metadata
    from coreserve.worker.sampling.sampler import Sampler
    from coreserve.worker.step.input_batch import RequestState

    def states(params):
        return [RequestState(str(i), [3, 9], 2, params, [0], 2, None, None, False, []) for i in range(3)]

    cpu = torch.device("cpu")
    plain = build_sampling_metadata(states(SamplingParams(temperature=0.0)), 50, cpu)
    assert plain.logit_rules is None
    sampler = Sampler(torch.Generator().manual_seed(0), TorchSamplingOps())
    logits = torch.randn(3, 50)
    assert sampler._process(logits, plain) is logits
    ruled = build_sampling_metadata(states(SamplingParams(temperature=0.0, logit_bias={7: 100.0})), 50, cpu)
    assert ruled.logit_rules is not None
    processed = sampler._process(logits, ruled)
    assert processed is not logits and processed.argmax(-1).tolist() == [7, 7, 7]


def test_multi_step_windows_apply_the_rules_at_every_step(tiny_path):
    from coreserve import LLM

    params = [
        SamplingParams(**GREEDY, logprobs=3, logit_bias={262: 4.0, 50: 7.0}, logprobs_mode="processed"),
        SamplingParams(**GREEDY, logprobs=3, allowed_token_ids=[11, 290, 3290]),
    ]
    with LLM(tiny_path, multiprocess=False, num_kv_blocks=64) as single:
        expected = single.generate(PROMPTS[:2], params, use_tqdm=False)
    with LLM(tiny_path, multiprocess=False, num_kv_blocks=64, num_scheduler_steps=4) as multi:
        got = multi.generate(PROMPTS[:2], params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(have.outputs[0].logprobs, want.outputs[0].logprobs):
            assert list(a) == list(b)
            assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=TOL)
    assert set(got[1].outputs[0].token_ids) <= {11, 290, 3290}


def test_the_engine_default_mode_may_be_a_logits_mode(tiny_path, hf_tiny):
    from coreserve import LLM

    with LLM(tiny_path, num_kv_blocks=64, logprobs_mode="raw_logits") as llm:
        output = llm.generate(PROMPTS[3], SamplingParams(**GREEDY, logprobs=4), use_tqdm=False)[0]
    assert_entries_match(output.outputs[0], completion_logits(hf_tiny, output))
