"""Stop strings, stop token ids, EOS, max_tokens and min_tokens, as vLLM applies them."""

from __future__ import annotations

import pytest
from conftest import PROMPTS, copy_model_with_eos

from coreserve import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm_inproc):
    """A greedy run with no stop conditions, to choose stops from."""
    return llm_inproc.generate(
        PROMPTS[0], SamplingParams(max_tokens=20, logprobs=1, **GREEDY), use_tqdm=False
    )[0]


def test_max_tokens_gives_exactly_that_many_with_reason_length(llm_inproc):
    out = llm_inproc.generate(PROMPTS[:3], SamplingParams(max_tokens=7, **GREEDY), use_tqdm=False)
    for o in out:
        assert len(o.outputs[0].token_ids) == 7
        assert (o.outputs[0].finish_reason, o.outputs[0].stop_reason) == ("length", None)
        assert o.finished


def test_stop_token_id_ends_on_that_token(llm_inproc, reference):
    stop_id = reference.outputs[0].token_ids[5]
    first = reference.outputs[0].token_ids.index(stop_id)
    out = llm_inproc.generate(
        PROMPTS[0], SamplingParams(max_tokens=20, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False
    )
    completion = out[0].outputs[0]
    assert completion.token_ids == reference.outputs[0].token_ids[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_a_stop_tokens_id_is_kept_and_its_text_is_not(llm_inproc, reference, tokenizer):
    """As vLLM: the token that ended a completion is in token_ids (with its logprob), its text is in the
    text only with include_stop_str_in_output."""
    stop_id = reference.outputs[0].token_ids[5]
    first = reference.outputs[0].token_ids.index(stop_id)
    params = dict(max_tokens=20, stop_token_ids=[stop_id], logprobs=0, skip_special_tokens=False, **GREEDY)
    completion = llm_inproc.generate(PROMPTS[0], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert completion.token_ids[-1] == stop_id and len(completion.logprobs) == len(completion.token_ids)
    assert completion.text == tokenizer.decode(reference.outputs[0].token_ids[:first])
    params["include_stop_str_in_output"] = True
    included = llm_inproc.generate(PROMPTS[0], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert included.token_ids == completion.token_ids
    assert included.text == tokenizer.decode(reference.outputs[0].token_ids[: first + 1])


def test_stop_string_cuts_text_but_keeps_tokens_and_logprobs_aligned(llm_inproc, reference, tokenizer):
    full_text = reference.outputs[0].text
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    params = SamplingParams(max_tokens=20, stop=[stop], logprobs=1, **GREEDY)
    completion = llm_inproc.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert completion.text == full_text[: full_text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(completion.logprobs) == len(completion.token_ids) < 20
    assert stop in tokenizer.decode(completion.token_ids)
    assert stop not in tokenizer.decode(completion.token_ids[:-1])

    params = SamplingParams(max_tokens=20, stop=stop, include_stop_str_in_output=True, **GREEDY)
    included = llm_inproc.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert included.text == full_text[: full_text.index(stop) + len(stop)]
    assert included.token_ids == completion.token_ids


@pytest.fixture(scope="module")
def eos_llm(tiny_path, reference, tmp_path_factory):
    """The tiny model with its EOS id set to the token greedy decoding emits fourth."""
    eos = reference.outputs[0].token_ids[3]
    path = copy_model_with_eos(tiny_path, tmp_path_factory.mktemp("eos") / "model", eos)
    with LLM(path, multiprocess=False, num_kv_blocks=64) as llm:
        yield llm, eos


def test_eos_stops_with_reason_stop_and_no_stop_reason(eos_llm, reference):
    llm, eos = eos_llm
    first = reference.outputs[0].token_ids.index(eos)
    completion = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[
        0
    ].outputs[0]
    assert completion.token_ids == reference.outputs[0].token_ids[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)


def test_ignore_eos_runs_to_max_tokens(eos_llm):
    llm, eos = eos_llm
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    completion = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 12 and eos in completion.token_ids
    assert completion.finish_reason == "length"


def test_min_tokens_masks_eos_until_reached(eos_llm):
    llm, eos = eos_llm
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8)
    completion = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) >= 8
    assert eos not in completion.token_ids[:8]
    assert completion.finish_reason in ("stop", "length")


def _request_with_output(output_ids: list[int], eos_ids: list[int], **params):
    from coreserve.engine_core.request import Request

    req = Request(
        req_id="r", client_id=b"c", client_req_id="r", prompt_token_ids=[1, 2, 3],
        params=SamplingParams(**params), arrival_time=0.0, eos_token_ids=eos_ids, logprobs_mode="raw",
    )
    for token_id in output_ids:
        req.append_token(token_id)
    return req


@pytest.mark.parametrize(
    "output_ids, params, expected",
    [
        ([5, 9], dict(max_tokens=2), ("stop", None)),  # the last token is EOS and the last allowed one
        ([5, 7], dict(max_tokens=2), ("stop", 7)),  # a second EOS id stops as a stop token id does
        ([5, 8], dict(max_tokens=2, stop_token_ids=[8]), ("stop", 8)),
        ([5, 6], dict(max_tokens=2), ("length", None)),
        ([9], dict(max_tokens=4, min_tokens=2), None),  # EOS before min_tokens does not stop
        ([5, 9], dict(max_tokens=2, ignore_eos=True), ("length", None)),
    ],
)
def test_eos_and_stop_ids_are_checked_before_the_length_caps(output_ids, params, expected):
    from coreserve.engine_core.stop import check_stop

    stop = check_stop(_request_with_output(output_ids, [9, 7], **params), max_model_len=100)
    assert (None if stop is None else (str(stop[0]), stop[1])) == expected


def test_the_model_length_stops_even_before_min_tokens():
    from coreserve.engine_core.stop import check_stop

    req = _request_with_output([5, 6], [9], max_tokens=10, min_tokens=8)
    assert str(check_stop(req, max_model_len=5)[0]) == "length"
