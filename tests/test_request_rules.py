"""The request rules against the engine's limits (coreserve/protocol/request_rules.py): pure logic, no model."""

from __future__ import annotations

import pytest

from coreserve.protocol.messages import HandshakeReply
from coreserve.protocol.request_rules import (
    RequestLimits,
    RequestRuleError,
    check_kv_room,
    check_logprobs,
    check_max_tokens_fit,
    check_request,
)
from coreserve.protocol.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, max_logprobs=5, num_kv_blocks=8, block_size=4)


def refusal(prompt, params=None, limits=LIMITS, **kwargs) -> RequestRuleError:
    with pytest.raises(RequestRuleError) as info:
        check_request(prompt, params or SamplingParams(max_tokens=4), limits, **kwargs)
    return info.value


def test_a_request_within_every_limit_passes():
    check_request([1, 2, 99], SamplingParams(max_tokens=4, logprobs=5, stop_token_ids=[0]), LIMITS)


@pytest.mark.parametrize(
    "prompt, params, param, words",
    [
        ([], None, "prompt", "the prompt is empty"),
        ([1] * 64, None, "prompt", "has 64 tokens, but max_model_len is 64"),
        ([1, 100], None, "prompt", "token id 100 is out of vocabulary"),
        ([-1, 5], None, "prompt", "token id -1 is negative: prompt must be token ids greater than or equal to 0"),
        ([1], SamplingParams(logprobs=6), "logprobs", "logprobs=6 is more than max_logprobs=5"),
        ([1], SamplingParams(prompt_logprobs=-1), "prompt_logprobs", "-1 (the whole vocabulary)"),
        ([1], SamplingParams(stop_token_ids=[100]), "stop_token_ids", "stop_token_ids: token id 100"),
        ([1], SamplingParams(logit_bias={7: 1.0, 150: 2.0}), "logit_bias", "logit_bias: token id 150"),
        ([1], SamplingParams(allowed_token_ids=[3, 101]), "allowed_token_ids", "token id 101"),
        ([1] * 20, SamplingParams(max_tokens=40), "max_tokens", "may need 15 KV blocks (60 tokens)"),
    ],
)
def test_each_broken_rule_is_a_value_error_naming_its_field(prompt, params, param, words):
    error = refusal(prompt, params)
    assert isinstance(error, ValueError) and error.param == param and words in str(error)


def test_token_id_fields_state_the_vocabulary_and_the_valid_range():
    message = str(refusal([1], SamplingParams(allowed_token_ids=[100])))
    assert "the vocabulary has 100 tokens" in message and "must be token ids in [0, 100)" in message


def test_max_logprobs_minus_one_allows_the_whole_vocabulary_but_not_more():
    unlimited = RequestLimits(
        vocab_size=100, max_model_len=64, max_logprobs=-1, num_kv_blocks=8, block_size=4
    )
    check_request([1], SamplingParams(logprobs=-1, prompt_logprobs=100), unlimited)
    assert "more than the vocabulary (100 tokens)" in str(
        refusal([1], SamplingParams(logprobs=101), unlimited)
    )


def test_the_engine_caps_max_tokens_at_the_context_while_the_strict_rule_refuses():
    params = SamplingParams(max_tokens=1000)
    roomy = RequestLimits(vocab_size=100, max_model_len=64, max_logprobs=5, num_kv_blocks=16, block_size=4)
    check_request([1] * 10, params, roomy)  # the engine stops it at max_model_len, "length"
    error = refusal([1] * 10, params, roomy, is_max_tokens_strict=True)
    assert error.param == "max_tokens" and "you requested 1010 tokens (10 in the prompt" in str(error)
    check_max_tokens_fit(10, 54, roomy)  # exactly the context


def test_kv_room_counts_whole_blocks_up_to_the_context():
    check_kv_room(20, 12, LIMITS)  # 32 tokens = 8 blocks of 4: exactly the cache
    with pytest.raises(RequestRuleError):
        check_kv_room(20, 13, LIMITS)
    check_kv_room(
        20,
        None,
        RequestLimits(vocab_size=100, max_model_len=32, max_logprobs=5, num_kv_blocks=8, block_size=4),
    )


def test_the_prompt_field_takes_the_callers_name():
    error = refusal([], prompt_param="messages")
    assert error.param == "messages" and "the messages is empty" in str(error)


def test_rules_are_checked_in_order_prompt_first():
    assert refusal([], SamplingParams(logprobs=50, max_tokens=4)).param == "prompt"
    assert refusal([1], SamplingParams(logprobs=50, stop_token_ids=[500])).param == "logprobs"


def test_limits_come_from_the_handshake():
    facts = HandshakeReply(
        protocol_version=0, error=None, vocab_size=10, max_model_len=20, max_logprobs=3,
        eos_token_ids=[2], num_kv_blocks=7, block_size=16,
    )
    limits = RequestLimits.of(facts)
    assert (limits.vocab_size, limits.max_model_len, limits.max_logprobs) == (10, 20, 3)
    assert (limits.num_kv_blocks, limits.block_size) == (7, 16)
    with pytest.raises(RequestRuleError):
        check_logprobs("top_logprobs", 4, limits)
