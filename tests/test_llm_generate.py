"""LLM.generate's inputs as vLLM takes them ({"prompt": ...} and {"prompt_token_ids": ...} dicts, lists of
them, truncate_prompt_tokens), the ids of logit rules checked against the vocabulary, and its progress bar."""

from __future__ import annotations

import re

import pytest
from conftest import PROMPTS

from coreserve import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_vllm_prompt_dicts_give_what_strings_and_token_ids_give(llm_inproc, tokenizer):
    ids = tokenizer(PROMPTS[2]).input_ids
    plain = llm_inproc.generate([PROMPTS[1], ids], GREEDY, use_tqdm=False)
    as_dicts = llm_inproc.generate(
        [{"prompt": PROMPTS[1]}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in as_dicts] == [o.outputs[0].token_ids for o in plain]
    assert as_dicts[0].prompt == PROMPTS[1] and as_dicts[0].prompt_token_ids == plain[0].prompt_token_ids
    single = llm_inproc.generate({"prompt": PROMPTS[1]}, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_a_prompt_dict_without_a_string_is_a_value_error(llm_inproc):
    with pytest.raises(ValueError, match="holds a string"):
        llm_inproc.generate({"prompt": 5}, GREEDY, use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_n_tokens(llm_inproc, tokenizer):
    ids = tokenizer(PROMPTS[12]).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=5)
    truncated = llm_inproc.generate(PROMPTS[12], params, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == ids[-5:]
    alone = llm_inproc.generate(ids[-5:], GREEDY, use_tqdm=False)[0]
    assert truncated.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = SamplingParams(temperature=0.0, max_tokens=6, truncate_prompt_tokens=-1)
    assert llm_inproc.generate(ids, whole, use_tqdm=False)[0].prompt_token_ids == ids  # within the limit


def test_truncate_prompt_tokens_minus_one_fits_a_long_prompt_into_max_model_len(tiny_path):
    from coreserve import LLM

    with LLM(tiny_path, multiprocess=False, max_model_len=32, num_kv_blocks=16) as llm:
        long = list(range(100, 200))
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(long, SamplingParams(max_tokens=1), use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=-1)
        assert llm.generate(long, params, use_tqdm=False)[0].prompt_token_ids == long[-31:]


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(logit_bias={50257: 1.0}), "logit_bias: token id 50257 is out of vocabulary"),
        (dict(allowed_token_ids=[3, 70000]), "allowed_token_ids: token id 70000 is out of vocabulary"),
        (dict(stop_token_ids=[99999]), "stop_token_ids: token id 99999 is out of vocabulary"),
    ],
)
def test_out_of_vocabulary_ids_are_named_with_the_vocabulary_size(llm_mp, params, message):
    with pytest.raises(ValueError, match=message) as info:
        llm_mp.generate(PROMPTS[0], SamplingParams(**params), use_tqdm=False)
    assert "the vocabulary has 50257 tokens" in str(info.value)


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        (dict(logprobs_mode="logits"), "logprobs_mode"),
    ],
)
def test_bad_logit_rule_values_are_value_errors(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_the_progress_bar_prints_its_zero_line_once(llm_inproc, capfd):
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    capfd.readouterr()
    llm_inproc.generate(PROMPTS[:4], params)
    err = capfd.readouterr().err
    assert len(re.findall(r"Processed prompts:\s+0%", err)) == 1, err
    assert re.search(r"Processed prompts: 100%.*4/4", err), err
