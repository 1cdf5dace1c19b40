"""POST /v1/completions through the official openai client: legacy logprobs equal LLM's, echo and
max_tokens 0 scoring, text offsets, tokens that are pieces of characters, streaming, several prompts,
and every bad field a 400 that names it."""

from __future__ import annotations

import pytest
from conftest import PROMPTS
from server_harness import API_KEY, MODEL, running_server, text_of

from coreserve import SamplingParams

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server():
    with running_server(
        "--api-key", API_KEY, "--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN)
    ) as (
        base,
        _,
    ):
        yield base


def legacy_expected(positions, token_ids, k):
    """What legacy completions must say for LLM's positions: token texts, logprobs, top-k dicts."""
    tokens, values, tops = [], [], []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        tokens.append(text_of(chosen.decoded_token))
        values.append(chosen.logprob)
        top = {text_of(lp.decoded_token): lp.logprob for lp in position.values() if lp.rank <= k}
        top[text_of(chosen.decoded_token)] = chosen.logprob
        tops.append(top)
    return tokens, values, tops


def test_completion_logprobs_equal_llm(client, llm_inproc):
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3
    )
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    request_output = llm_inproc.generate(PROMPTS[1], params, use_tqdm=False)[0]
    expected = request_output.outputs[0]
    choice = result.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "length"
    tokens, values, tops = legacy_expected(expected.logprobs, expected.token_ids, 3)
    assert choice.logprobs.tokens == tokens
    assert choice.logprobs.token_logprobs == values
    assert choice.logprobs.top_logprobs == tops
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens == len(request_output.prompt_token_ids)


def test_echo_with_max_tokens_zero_scores_the_prompt(client, llm_inproc):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=0, echo=True, logprobs=2)
    expected = llm_inproc.generate(
        PROMPTS[2], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    choice = result.choices[0]
    assert choice.text == PROMPTS[2] and choice.finish_reason == "length"
    ids = expected.prompt_token_ids
    tokens, values, tops = legacy_expected(expected.prompt_logprobs[1:], ids[1:], 2)
    assert choice.logprobs.tokens == [text_of("In"), *tokens]
    assert choice.logprobs.token_logprobs == [None, *values]
    assert choice.logprobs.top_logprobs == [None, *tops]
    assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(ids)


def test_echo_one_token_gives_the_same_number_in_token_and_top_logprobs(client):
    """Evaluation harnesses send echo, max_tokens 1, logprobs 1 and look each token up in top_logprobs."""
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[13], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == result.usage.prompt_tokens + 1
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == value


def test_text_offsets_index_the_choice_text(client):
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, echo=True, logprobs=0, temperature=0
    )
    choice = result.choices[0]
    offsets, tokens = choice.logprobs.text_offset, choice.logprobs.tokens
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for start, end, token in zip(offsets, [*offsets[1:], len(choice.text)], tokens):
        if not token.startswith("bytes:"):
            assert choice.text[start:end] == token


def test_a_token_that_is_part_of_a_character_is_written_as_its_bytes(client):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=0, echo=True, logprobs=1)
    tokens = result.choices[0].logprobs.tokens
    assert any(t.startswith("bytes:") for t in tokens), tokens
    raw = b"".join(
        bytes.fromhex(t[len("bytes:") :].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
        for t in tokens
    )
    assert raw.decode("utf-8") == PROMPTS[10]


def test_streamed_completion_concatenates_to_the_whole_response(client):
    request = dict(model=MODEL, prompt=PROMPTS[5], max_tokens=12, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**request).choices[0]
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    chunks = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [v for c in chunks if c.logprobs for v in getattr(c.logprobs, field)]
        assert streamed == getattr(whole.logprobs, field)
    assert chunks[-1].finish_reason == "length" and usage.completion_tokens == 12


def test_a_stream_cut_by_a_stop_string_concatenates_to_the_whole_response(client):
    free = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=1)
    stop = free.choices[0].logprobs.tokens[6]  # a stop string the greedy completion is sure to meet
    request = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=1, stop=[stop])
    whole = client.completions.create(**request).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**request, stream=True) if c.choices]
    assert whole.finish_reason == chunks[-1].finish_reason == "stop" and stop not in whole.text
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens


def test_the_keys_vllm_writes_as_null_are_there_unasked_and_filled_when_asked(client, tokenizer):
    """vLLM's response models write these unset; code reads them as attributes (an AttributeError if absent)."""
    request = dict(model=MODEL, prompt=PROMPTS[4], max_tokens=3, temperature=0)
    whole = client.completions.create(**request)
    choice = whole.choices[0]
    assert choice.token_ids is None and choice.prompt_token_ids is None and choice.prompt_logprobs is None
    assert choice.stop_reason is None and choice.logprobs is None
    assert whole.kv_transfer_params is None and whole.service_tier is None and whole.system_fingerprint is None
    chunks = list(client.completions.create(**request, stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(each.token_ids is None and each.prompt_token_ids is None for c in chunks for each in c.choices)
    ids = {"return_token_ids": True}
    asked = client.completions.create(**request, extra_body=ids).choices[0]
    assert asked.prompt_token_ids == tokenizer(PROMPTS[4]).input_ids and len(asked.token_ids) == 3
    streamed = [each for c in client.completions.create(**request, stream=True, extra_body=ids) for each in c.choices]
    assert streamed[0].prompt_token_ids == asked.prompt_token_ids
    assert all(each.prompt_token_ids is None for each in streamed[1:])
    assert [t for each in streamed for t in each.token_ids] == asked.token_ids


def test_several_prompts_and_n_give_one_choice_each(client, tokenizer):
    ids = tokenizer(PROMPTS[3]).input_ids
    result = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, n=2, seed=3)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 2 * len(ids) and result.usage.completion_tokens == 16
    assert result.choices[0].text == result.choices[2].text  # same prompt, seed and completion index


def test_vllm_prompt_logprobs_extension(http, llm_inproc):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1, "prompt_logprobs": 1}
    rows = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    expected = llm_inproc.generate(
        PROMPTS[0], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0]
    assert rows[0] is None and len(rows) == len(expected.prompt_token_ids)
    for row, position in zip(rows[1:], expected.prompt_logprobs[1:]):
        assert {int(t): v["logprob"] for t, v in row.items()} == {t: lp.logprob for t, lp in position.items()}


BAD_FIELDS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 0}, "n"),
    ({"seed": 2**63}, "seed"),
    ({"stop_token_ids": [-(2**63) - 1]}, "stop_token_ids"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"prompt": [50257]}, "prompt"),
    ({"prompt": "word " * MAX_MODEL_LEN}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"logit_bias": {"50257": -100}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"7": 100.5}}, "logit_bias"),
    ({"prompt": None}, "prompt"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
]


@pytest.mark.parametrize(("change", "param"), BAD_FIELDS)
def test_a_bad_field_is_a_400_naming_it_and_the_next_request_succeeds(http, change, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **change}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    good = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert good.status_code == 200


def test_a_bad_streamed_request_is_a_400_before_the_stream(http):
    body = {"model": MODEL, "prompt": "Hello", "logprobs": 99, "stream": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


# vLLM's own tests' matches: tests/entrypoints/openai/test_chat.py::test_long_seed (pydantic's bound
# names), completion/test_completion_error.py (negative ids), completion/test_empty_prompt_list.py,
# test_prompt_validation.py (ids past the vocabulary)
VLLM_WORDING = [
    ({"seed": 2**63}, "less_than_equal"),
    ({"seed": -(2**63) - 1}, "greater_than_equal"),
    ({"prompt": [-1]}, "greater than or equal to 0"),
    ({"prompt": [[-1]]}, "greater than or equal to 0"),
    ({"prompt": []}, "prompt or prompt_embeds"),
    ({"prompt": [50257]}, "out of vocabulary"),
]


@pytest.mark.parametrize(("change", "words"), VLLM_WORDING)
def test_refusals_carry_the_words_vllms_tests_match(http, change, words):
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, **change})
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


def test_null_stream_options_read_as_false(http):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stream": True}
    options = {"include_usage": None, "continuous_usage_stats": None}
    response = http.post("/v1/completions", json={**body, "stream_options": options})
    assert response.status_code == 200 and '"usage"' not in response.text.replace('"usage":null', "")
    unstreamed = http.post("/v1/completions", json={**body, "stream": False, "stream_options": options})
    assert unstreamed.status_code == 400  # stream_options without a stream, as vLLM
