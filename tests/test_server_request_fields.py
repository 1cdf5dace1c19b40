"""Request fields as vLLM's own tests send them (issue 20), through the official openai client (vLLM's
fields in extra_body): prompt_logprobs null when not asked for, legacy top_logprobs with the position's
own token first, every unimplemented field a 400 naming it, and the fields implemented here:
logit_bias, allowed_token_ids, return_tokens_as_token_ids, return_token_ids, truncate_prompt_tokens,
chat prompt_logprobs (and the completions' scoring fields), echo and continue_final_message."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import PROMPTS
from server_harness import MODEL, chat_template_file, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--chat-template", chat_template_file(tmp_path_factory), "--num-kv-blocks", "256"]
    with running_server(*flags) as (base, _):
        yield base


def user(text: str = "Name a colour.") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_prompt_logprobs_is_null_when_not_asked_for(client):
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert "prompt_logprobs" in completion.choices[0].model_extra
    assert completion.choices[0].prompt_logprobs is None
    chat = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=2)
    assert "prompt_logprobs" in chat.model_extra and chat.prompt_logprobs is None


def test_legacy_top_logprobs_put_the_position_token_first(client):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=16, logprobs=3, seed=2)
    logprobs = result.choices[0].logprobs
    assert all(next(iter(top)) == token for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
    best = [max(top.values()) for top in logprobs.top_logprobs]
    assert any(value < high for value, high in zip(logprobs.token_logprobs, best))  # a sampled non-top token


UNSUPPORTED = [
    ("completions", {"structural_tag": "x"}, "structural_tag"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("completions", {"best_of_typo": 2}, "best_of_typo"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),  # no tools
    ("chat", {"tools": []}, "tools"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("chat", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("chat", {"chat_template": "{{ x }}"}, "chat_template"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("endpoint", "change", "param"), UNSUPPORTED)
def test_an_unimplemented_field_is_a_400_naming_it(client, endpoint, change, param):
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "completions":
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=change)
        else:
            client.chat.completions.create(model=MODEL, messages=user(), max_tokens=2, extra_body=change)
    assert info.value.body["param"] == param and param in info.value.body["message"]


def test_no_op_values_and_ignorable_fields_pass(client):
    harmless = {
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "use_beam_search": False,
        "user": "someone",
        "metadata": {"k": "v"},
    }
    result = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=2, extra_body=harmless)
    assert result.usage.completion_tokens == 2


def test_a_null_prompt_is_a_clean_400(server):
    response = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": None}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt"
    assert error["message"].startswith("prompt must be a string") and "got null" in error["message"]
    assert "function-after" not in error["message"] and "[" not in error["message"]


def test_logit_bias_of_100_makes_greedy_pick_that_token(client):
    result = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"1820": 100}, logprobs=0,
        extra_body={"return_token_ids": True},
    )
    assert result.choices[0].token_ids == [1820] * 4


@pytest.mark.parametrize("bias", [{"50257": 1}, {"abc": 1}, {"5": 101}, {"-1": 1}])
def test_a_bad_logit_bias_is_a_400_naming_it(client, bias):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logit_bias=bias)
    assert info.value.body["param"] == "logit_bias" and next(iter(bias)) in info.value.body["message"]


def test_allowed_token_ids_limit_what_is_sampled(client):
    allowed = [262, 290, 318]
    result = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=8, seed=1,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    )
    assert set(result.choices[0].token_ids) <= set(allowed) and len(result.choices[0].token_ids) == 8


def test_allowed_token_ids_that_min_tokens_bans_all_are_a_400_and_the_server_goes_on(client, tokenizer):
    """Before: every logit -inf under the ban, so NaN logprobs and an arbitrary token came back."""
    eos = tokenizer.eos_token_id
    cases = [{"allowed_token_ids": [eos], "min_tokens": 2},
             {"allowed_token_ids": [262, 290], "stop_token_ids": [262, 290], "min_tokens": 1, "ignore_eos": True}]
    for extra in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=1, extra_body=extra)
        assert info.value.body["param"] == "allowed_token_ids" and "min_tokens" in info.value.body["message"]
    allowed = {"allowed_token_ids": [eos, 262], "min_tokens": 2, "return_token_ids": True}  # one token left
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=1, extra_body=allowed)
    assert result.choices[0].token_ids[:2] == [262, 262]
    assert all(lp is not None and lp == lp for lp in result.choices[0].logprobs.token_logprobs)  # no NaN


def test_chat_takes_the_scoring_fields_of_completions(client):
    """prompt_logprob_token_ids and prompt_logprobs_temperature on a chat: its templated prompt scored as
    a completion of the same ids scores it, candidates at every position; a bad one is a 400 by name."""
    scoring = {"prompt_logprobs": 1, "prompt_logprob_token_ids": [11, 13, 262], "prompt_logprobs_temperature": 0.5}
    chat = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=1, temperature=0,
                                          extra_body={**scoring, "return_token_ids": True})
    completion = client.completions.create(model=MODEL, prompt=chat.prompt_token_ids, max_tokens=1,
                                           temperature=0, extra_body=scoring)
    assert chat.prompt_logprobs == completion.choices[0].prompt_logprobs
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == len(chat.prompt_token_ids)
    assert all({"11", "13", "262"} <= set(entry) for entry in chat.prompt_logprobs[1:])
    only = client.chat.completions.create(model=MODEL, messages=user(), max_tokens=1,
                                          extra_body={"prompt_logprob_token_ids": [11]})
    assert all("11" in entry for entry in only.prompt_logprobs[1:])  # candidates alone: k = 0
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user(), max_tokens=1,
                                       extra_body={"prompt_logprobs_temperature": 0.5})
    assert info.value.body["param"] == "prompt_logprobs_temperature"


def test_return_token_ids_and_tokens_as_token_ids(client, tokenizer):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    request = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2, extra_body=extra)
    choice = client.completions.create(**request).choices[0]
    assert choice.prompt_token_ids == tokenizer(PROMPTS[1]).input_ids and len(choice.token_ids) == 6
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    chunks = [c.choices[0] for c in client.completions.create(**request, stream=True)]
    assert [t for c in chunks for t in c.token_ids] == choice.token_ids
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids
    chat = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=3, temperature=0, logprobs=True, extra_body=extra
    )
    assert [e.token for e in chat.choices[0].logprobs.content] == [
        f"token_id:{t}" for t in chat.choices[0].token_ids
    ]
    assert chat.prompt_token_ids and len(chat.choices[0].token_ids) == 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tokenizer):
    ids = tokenizer(PROMPTS[5]).input_ids
    extra = {"truncate_prompt_tokens": 5, "return_token_ids": True}
    result = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=1, extra_body=extra)
    assert result.usage.prompt_tokens == 5 and result.choices[0].prompt_token_ids == ids[-5:]


def test_chat_prompt_logprobs_cover_every_prompt_token(client):
    result = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    rows = result.prompt_logprobs
    assert rows[0] is None and len(rows) == result.usage.prompt_tokens and all(rows[1:])


def test_chat_continue_final_message_and_echo(client, tokenizer):
    messages = [*user(), {"role": "assistant", "content": "My favourite colour is"}]
    extra = {
        "continue_final_message": True,
        "add_generation_prompt": False,
        "echo": True,
        "return_token_ids": True,
    }
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_body=extra)
    assert result.choices[0].message.content.startswith("My favourite colour is")
    assert tokenizer.decode(result.prompt_token_ids).endswith("assistant\nMy favourite colour is")
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed).startswith("My favourite colour is")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, extra_body={"continue_final_message": True}
        )
    assert info.value.body["param"] == "continue_final_message"  # with add_generation_prompt (default)
