"""Prompt scoring over HTTP through a real server on loopback: vLLM's `prompt_logprob_token_ids` and
`prompt_logprobs_temperature` on /v1/completions (the official openai client), and TRL's
`/get_sequence_logprobs/` shape (httpx), behind --enable-rl-endpoints and the API key (its 404 without the flag: tests/test_rl_server.py). Values are checked
against the server's own full rows and HF's forward of the tiny model."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import HF_TOLERANCE, IS_BF16_MODE
from server_harness import API_KEY, MODEL, running_server

SEQUENCE = [464, 3139, 286, 4881, 318, 6342, 13, 383, 3139, 286, 4486, 318]
CANDIDATES = [11, 13, 262, 318]


@pytest.fixture(scope="module")
def base():
    flags = ("--enable-rl-endpoints", "--api-key", API_KEY, "--max-logprobs", "-1", "--num-kv-blocks", "64")
    with running_server(*flags) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as session:
        yield session


def prompt_logprobs(client, **extra) -> list:
    reply = client.completions.create(
        model=MODEL, prompt=SEQUENCE, max_tokens=1, temperature=0.0, extra_body=extra
    )
    return reply.choices[0].prompt_logprobs


def test_completions_show_the_candidates_with_their_ranks(client):
    top = prompt_logprobs(client, prompt_logprobs=40)
    scored = prompt_logprobs(client, prompt_logprobs=1, prompt_logprob_token_ids=CANDIDATES)
    assert scored[0] is None
    for position in range(1, len(SEQUENCE)):
        entry = scored[position]
        assert {str(t) for t in CANDIDATES} <= set(entry)
        assert str(SEQUENCE[position]) in entry
        for token_id in CANDIDATES:
            if str(token_id) in top[position]:
                assert entry[str(token_id)] == top[position][str(token_id)]  # same logprob, rank, text
            else:
                assert entry[str(token_id)]["rank"] > 40


def test_completions_score_at_a_temperature(client, hf_tiny):
    scored = prompt_logprobs(client, prompt_logprobs=3, prompt_logprobs_temperature=0.5)
    with torch.no_grad():
        hf = torch.log_softmax(hf_tiny(torch.tensor([SEQUENCE])).logits[0].double() / 0.5, dim=-1)
    for position in range(1, len(SEQUENCE)):
        for token_id, value in scored[position].items():
            assert abs(value["logprob"] - hf[position - 1, int(token_id)].item()) <= HF_TOLERANCE


def test_completions_refuse_bad_scoring_fields_by_name(client):
    for extra, param in [
        ({"prompt_logprob_token_ids": [10**7]}, "prompt_logprob_token_ids"),
        ({"prompt_logprob_token_ids": [[1], [2]]}, "prompt_logprob_token_ids"),
        ({"prompt_logprobs_temperature": 0.5}, "prompt_logprobs_temperature"),
        ({"prompt_logprobs": 0, "prompt_logprobs_temperature": -1.0}, "prompt_logprobs_temperature"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            prompt_logprobs(client, **extra)
        assert info.value.body["param"] == param, (extra, info.value.body)
    assert prompt_logprobs(client, prompt_logprob_token_ids=[5])[1]["5"]["rank"] >= 1  # still serving


def test_get_sequence_logprobs_answers_trls_shape(http, hf_tiny):
    prompt_length, k = 5, 4
    body = {"sequences": [SEQUENCE, SEQUENCE[:8]], "prompt_lengths": [prompt_length, 3], "top_logprobs": k}
    reply = http.post("/get_sequence_logprobs/", json={**body, "temperature": 2.0})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert set(answer) == {"logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids"}
    assert [len(rows) for rows in answer["logprobs"]] == [len(SEQUENCE) - prompt_length, 5]
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([SEQUENCE])).logits[0].double()
    hf = torch.log_softmax(logits / 2.0, dim=-1)
    for j, position in enumerate(range(prompt_length, len(SEQUENCE))):
        ids, values = answer["logprob_token_ids"][0][j], answer["logprobs"][0][j]
        assert len(ids) == k and values == sorted(values, reverse=True)
        top = hf[position - 1].topk(k)
        if IS_BF16_MODE:  # near-ties may swap places in bf16; the k values still match HF's k best
            assert all(abs(a - b) <= HF_TOLERANCE for a, b in zip(values, top.values.tolist()))
        else:
            assert ids == top.indices.tolist()
        for token_id, value in zip(ids, values):
            assert abs(value - hf[position - 1, token_id].item()) <= HF_TOLERANCE
        assert answer["actual_token_ids"][0][j] == [SEQUENCE[position]]
        actual = answer["actual_logprobs"][0][j][0]
        assert abs(actual - hf[position - 1, SEQUENCE[position]].item()) <= HF_TOLERANCE  # even outside top-k


def test_get_sequence_logprobs_refuses_bad_bodies_and_needs_the_key(http, base):
    for body, param in [
        ({"sequences": [SEQUENCE], "prompt_lengths": [0]}, "prompt_lengths"),
        ({"sequences": [SEQUENCE], "prompt_lengths": [1, 2]}, "prompt_lengths"),
        ({"sequences": [[10**7, 1]], "prompt_lengths": [1]}, "sequences"),
        ({"sequences": [SEQUENCE], "prompt_lengths": [1], "temperature": 0.0}, "temperature"),
        ({"sequences": [SEQUENCE], "prompt_lengths": [1], "chunk_size": 2}, "chunk_size"),
    ]:
        reply = http.post("/get_sequence_logprobs/", json=body)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["param"] == param, (body, reply.json())
    keyless = httpx.post(
        f"{base}/get_sequence_logprobs/", json={"sequences": [SEQUENCE], "prompt_lengths": [1]}
    )
    assert keyless.status_code == 401


def test_a_generating_server_refuses_the_pooling_routes_and_keeps_sglangs_score(http):
    """/v1/score is SGLang's label scoring here (tests/test_label_scores.py); vLLM's pooling body is refused."""
    for path, body in (("/v1/embeddings", {"input": "a"}), ("/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"})):
        answer = http.post(path, json=body)
        assert answer.status_code == 400 and "needs a pooling model (--runner pooling)" in answer.json()["error"]["message"]
    scored = http.post("/v1/score", json={"query": "The capital", "items": [" of"], "label_token_ids": [286]})
    assert scored.status_code == 200 and 0 < scored.json()["scores"][0][0] < 1
