"""POST /v1/chat/completions through the official openai client: the chat template, logprobs with
exact bytes equal to LLM's, streaming, and bad fields as 400s; hidden states on both routes (base64 of
LLM's bits, whole in a stream's finishing chunk)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from server_harness import CHATML, chat_template_file, running_server

from coreserve import SamplingParams

SYSTEM, QUESTION = "You are terse.", "Name a colour."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--chat-template", chat_template_file(tmp_path_factory), "--num-kv-blocks", "256"]
    with running_server(*flags, "--served-model-name", "tiny-chat") as (base, _):
        yield base


def messages():
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
    ]


def test_chat_logprobs_equal_llm_with_exact_bytes(client, llm_inproc, tokenizer):
    result = client.chat.completions.create(
        model="tiny-chat", messages=messages(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    flat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(flat, chat_template=CHATML, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    expected = llm_inproc.generate(ids, params, use_tqdm=False)[0].outputs[0]
    choice = result.choices[0]
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert result.usage.prompt_tokens == len(ids) and result.model == "tiny-chat"
    assert len(choice.logprobs.content) == 8
    for entry, token_id, position in zip(choice.logprobs.content, expected.token_ids, expected.logprobs):
        chosen = position[token_id]
        assert entry.logprob == chosen.logprob
        assert bytes(entry.bytes) == chosen.decoded_token.encode("utf-8", "surrogateescape")
        top = sorted((lp for lp in position.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [t.logprob for t in entry.top_logprobs] == [lp.logprob for lp in top]
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [
            lp.decoded_token.encode("utf-8", "surrogateescape") for lp in top
        ]


def test_streamed_chat_concatenates_to_the_whole_response(client):
    request = dict(
        model="tiny-chat", messages=messages(), max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    whole = client.chat.completions.create(**request).choices[0]
    chunks = list(
        client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in choices) == whole.message.content
    assert [e for c in choices if c.logprobs for e in c.logprobs.content] == whole.logprobs.content
    assert choices[-1].finish_reason == whole.finish_reason == "length"


def test_the_keys_vllm_writes_as_null_are_there_unasked_and_filled_when_asked(client):
    """vLLM's response models write these unset; code reads them as attributes (an AttributeError if absent)."""
    request = dict(model="tiny-chat", messages=messages(), max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**request)
    choice, message = plain.choices[0], plain.choices[0].message
    assert choice.token_ids is None and plain.prompt_token_ids is None and choice.stop_reason is None
    assert plain.prompt_logprobs is None and plain.kv_transfer_params is None
    assert plain.service_tier is None and plain.system_fingerprint is None
    assert message.reasoning is None and message.reasoning_content is None and message.tool_calls == []
    assert message.refusal is None and message.function_call is None and message.audio is None
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[0].prompt_token_ids is None
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert all(c.token_ids is None and c.logprobs is None and c.delta.reasoning_content is None for c in streamed)
    ids = {"return_token_ids": True}
    asked = client.chat.completions.create(**request, extra_body=ids)
    assert len(asked.choices[0].token_ids) == 4 and len(asked.prompt_token_ids) == plain.usage.prompt_tokens
    asked_chunks = list(client.chat.completions.create(**request, stream=True, extra_body=ids))
    assert asked_chunks[0].prompt_token_ids == asked.prompt_token_ids
    assert [t for c in asked_chunks for each in c.choices for t in each.token_ids] == asked.choices[0].token_ids


def test_vllm_prompt_logprobs_extension(server):
    body = {"model": "tiny-chat", "messages": messages(), "max_tokens": 1, "prompt_logprobs": 0}
    result = httpx.post(server + "/v1/chat/completions", json=body, timeout=60).json()
    rows = result["prompt_logprobs"]
    assert rows[0] is None and len(rows) == result["usage"]["prompt_tokens"]
    assert all(len(row) == 1 for row in rows[1:])  # the prompt token alone at k = 0


def test_n_completions_each_with_their_own_logprobs(client):
    result = client.chat.completions.create(
        model="tiny-chat", messages=messages(), max_tokens=5, n=3, seed=11, logprobs=True
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(len(c.logprobs.content) == 5 for c in result.choices)
    assert all(c.logprobs.content[0].top_logprobs == [] for c in result.choices)  # top_logprobs 0
    assert result.usage.completion_tokens == 15


BAD_FIELDS = [
    ({"messages": []}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
    ({"max_completion_tokens": 10**6}, "max_tokens"),
]


@pytest.mark.parametrize(("change", "param"), BAD_FIELDS)
def test_a_bad_field_is_a_400_naming_it(server, change, param):
    body = {"model": "tiny-chat", "messages": messages(), "max_tokens": 2, **change}
    response = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _hidden(choice) -> np.ndarray:
    """A choice's hidden_states as docs/serving.md describes them: base64 of little-endian float32."""
    shown = choice.model_extra["hidden_states"]
    assert shown["dtype"] == "<f4"
    return np.frombuffer(base64.b64decode(shown["data"]), dtype="<f4").reshape(shown["shape"]), shown


def test_hidden_states_on_completions_and_chat_are_llms_bits(client, llm_inproc):
    extra = {"return_hidden_states": [0, -1], "hidden_states_positions": "output", "ignore_eos": True,
             "return_token_ids": True}
    prompt = [1000 + 7 * i for i in range(23)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_hidden_states=[0, -1],
                            hidden_states_positions="output")
    expected = llm_inproc.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    done = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
    got, shown = _hidden(done.choices[0])
    assert shown["first_position"] == len(prompt) - 1 and got.shape == (2, 6, 256)
    assert np.array_equal(got, expected.hidden_states)
    chunks = list(client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body=extra
    ))
    carrying = [c.choices[0] for c in chunks if c.choices and c.choices[0].model_extra.get("hidden_states")]
    assert len(carrying) == 1 and carrying[0].finish_reason is not None
    assert np.array_equal(_hidden(carrying[0])[0], expected.hidden_states)
    chat = client.chat.completions.create(model="tiny-chat", messages=messages(), max_tokens=4, temperature=0,
                                          extra_body={**extra, "hidden_states_positions": "all"})
    ids = chat.prompt_token_ids + chat.choices[0].token_ids[:-1]
    alone = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, return_hidden_states=[0, -1])
    by_llm = llm_inproc.generate([{"prompt_token_ids": chat.prompt_token_ids}], alone, use_tqdm=False)[0]
    assert by_llm.outputs[0].token_ids == chat.choices[0].token_ids
    assert np.array_equal(_hidden(chat.choices[0])[0], by_llm.outputs[0].hidden_states)
    assert _hidden(chat.choices[0])[0].shape == (2, len(ids), 256)
    plain = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2)
    assert "hidden_states" not in plain.choices[0].model_extra
    with pytest.raises(Exception, match="return_hidden_states index 9"):
        client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2,
                                  extra_body={"return_hidden_states": [9]})
