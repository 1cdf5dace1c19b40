"""Label scoring for graders through a real server on loopback, on SmolLM2: SGLang's `POST /v1/score`
with the requests of SGLang's own test (test/srt/test_score_api.py: its queries, items, label tokens and
item_first) and vLLM's `POST /generative_scoring` (vllm/entrypoints/openai/generative_scoring), checked
against HF's forward of the same token ids and, bit for bit, against /v1/completions' prompt logprobs
of the same position."""

from __future__ import annotations

import math

import httpx
import pytest
from conftest import IS_BF16_MODE
from hf_reference import gguf_reference
from server_harness import API_KEY, running_server

from coreserve.frontend.engine.engine_args import load_tokenizer
from coreserve.protocol.builtin_model import builtin_model_path

TOLERANCE = 0.3 if IS_BF16_MODE else 1e-4  # on logprobs (test_real_model.py's bounds)
CASES = [  # SGLang's: (query, items, item_first)
    ("I pledge allegiance", ["", " to"], False),
    (" is a city", ["Tokyo", "Japan"], True),
]


@pytest.fixture(scope="module")
def path() -> str:
    return builtin_model_path("smollm2")


@pytest.fixture(scope="module")
def tokenizer(path):
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def labels(tokenizer) -> list[int]:
    return [tokenizer(t, add_special_tokens=False).input_ids[0] for t in (" to", " the")]


@pytest.fixture(scope="module")
def http(path):
    flags = ("--api-key", API_KEY, "--served-model-name", "coreserve", "--max-logprobs", "20")
    flags += ("--dtype", "bfloat16") if IS_BF16_MODE else ()
    with running_server(*flags, model=path) as (base, _):
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as session:
            yield session


def hf_label_logprobs(path: str, sequences: list[list[int]], labels: list[int]) -> list[list[float]]:
    answers = gguf_reference(path).teacher_forced(sequences, [{len(s) - 1: labels} for s in sequences])
    return [[rows[len(s) - 1].logprobs[label] for label in labels] for rows, s in zip(answers, sequences)]


def softmax(logprobs: list[float]) -> list[float]:
    weights = [math.exp(lp - max(logprobs)) for lp in logprobs]
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize("apply_softmax", [True, False])
@pytest.mark.parametrize("query, items, item_first", CASES)
def test_sglangs_score_equals_hf(http, path, tokenizer, labels, query, items, item_first, apply_softmax):
    body = dict(query=query, items=items, label_token_ids=labels, apply_softmax=apply_softmax,
                item_first=item_first, model="coreserve")
    reply = http.post("/v1/score", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["object"] == "scoring" and answer["model"] == "coreserve"
    texts = [item + query if item_first else query + item for item in items]  # SGLang joins the texts
    sequences = [tokenizer(t).input_ids for t in texts]
    assert answer["usage"]["prompt_tokens"] == sum(map(len, sequences))
    for scores, expected in zip(answer["scores"], hf_label_logprobs(path, sequences, labels)):
        assert len(scores) == len(labels)
        if apply_softmax:
            assert sum(scores) == pytest.approx(1.0, abs=1e-9)
            expected = [math.log(p) for p in softmax(expected)]
        assert max(abs(math.log(s) - e) for s, e in zip(scores, expected)) <= TOLERANCE


def test_token_ids_are_concatenated_and_scores_are_the_prompt_logprobs_bits(http, tokenizer, labels):
    query, item = tokenizer("The capital of France is").input_ids, tokenizer(" Paris", add_special_tokens=False).input_ids
    body = dict(query=query, items=[item], label_token_ids=labels, apply_softmax=False)
    scores = http.post("/v1/score", json=body).json()["scores"][0]
    completion = http.post("/v1/completions", json=dict(
        prompt=query + item + [labels[0]], max_tokens=1, prompt_logprobs=0, prompt_logprob_token_ids=labels,
    )).json()
    last = completion["choices"][0]["prompt_logprobs"][-1]
    assert scores == [math.exp(last[str(label)]["logprob"]) for label in labels]  # the same bits, exp'd


def test_vllms_generative_scoring_equals_hf(http, path, tokenizer, labels):
    query, items = "Is this city the capital of France?", [" Paris", " London"]
    body = dict(query=query, items=items, label_token_ids=labels, model="coreserve")
    reply = http.post("/generative_scoring", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["object"] == "list" and answer["id"].startswith("generative-scoring")
    assert [d["index"] for d in answer["data"]] == [0, 1] and {d["object"] for d in answer["data"]} == {"score"}
    query_ids = tokenizer(query).input_ids  # vLLM: the query with special tokens, items without, joined
    sequences = [query_ids + tokenizer(item, add_special_tokens=False).input_ids for item in items]
    assert answer["usage"] == {"prompt_tokens": sum(map(len, sequences)), "completion_tokens": 0,
                               "total_tokens": sum(map(len, sequences))}
    for datum, expected in zip(answer["data"], hf_label_logprobs(path, sequences, labels)):
        assert abs(math.log(datum["score"]) - math.log(softmax(expected)[0])) <= TOLERANCE
    item_first = http.post("/generative_scoring", json={**body, "item_first": True, "apply_softmax": False}).json()
    sequences = [tokenizer(item, add_special_tokens=False).input_ids + query_ids for item in items]
    for datum, expected in zip(item_first["data"], hf_label_logprobs(path, sequences, labels)):
        assert abs(math.log(datum["score"]) - expected[0]) <= TOLERANCE


def test_bad_requests_are_refused_by_name_and_the_server_keeps_serving(http, labels):
    cases = [
        ("/v1/score", dict(query="a", items=["b"], label_token_ids=[10**6]), "label_token_ids"),
        ("/v1/score", dict(query="a", items=[[1, 2]], label_token_ids=labels), "items"),  # text with ids
        ("/v1/score", dict(query="a", label_token_ids=labels), "items"),
        ("/v1/score", dict(query="a", items=["b"]), "label_token_ids"),
        ("/v1/score", dict(query="a", items=["b"], label_token_ids=labels, temperature=0.5), "temperature"),
        ("/generative_scoring", dict(query="a", items=[], label_token_ids=labels), "items"),
        ("/generative_scoring", dict(query="a", items=["b"], label_token_ids=[]), "label_token_ids"),
        ("/generative_scoring", dict(query="a", items=["b"], label_token_ids=labels, priority=1), "priority"),
    ]
    for route, body, field in cases:
        reply = http.post(route, json=body)
        assert reply.status_code == 400, (route, body, reply.text)
        assert field in reply.text, (field, reply.text)
    assert http.post("/v1/score", json=dict(query="a", items=[], label_token_ids=labels)).json()["scores"] == []
    unauthorized = httpx.post(str(http.base_url.join("/generative_scoring")), json=dict(query="a", items=["b"]))
    assert unauthorized.status_code == 401  # behind the API key, as /v1/score is
    assert http.post("/v1/score", json=dict(query="a", items=["b"], label_token_ids=labels)).status_code == 200
