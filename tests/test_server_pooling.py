"""The pooling routes through a real `coreserve serve --runner pooling` on loopback (docs/serving.md,
"Pooling"): /v1/embeddings through the official openai client (its default base64 and float, the same
bits), /pooling, vLLM's /score (and /v1/score with its body) and /rerank on a random bidirectional Gemma 3
embedding model, /classify on a random Qwen2 classifier against HF; the generation routes refused by name.
The pooling routes on a generating server: tests/test_server_scoring.py."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from pooling_models import st_reference, write_bidirectional_gemma3, write_qwen2_classifier
from server_harness import API_KEY, running_server

TEXTS = ["The capital of France is Paris.", "a cat sat on the mat, and then it sat on another mat", "Paris"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_bidirectional_gemma3(tmp_path_factory.mktemp("gemma"))
    flags = ("--runner", "pooling", "--api-key", API_KEY, "--served-model-name", "emb", "--num-kv-blocks", "64")
    with running_server(*flags, model=path) as (base, _):
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
            yield path, base, http


def test_the_openai_clients_embeddings_are_sentence_transformers_in_float_and_base64(gemma):
    path, base, http = gemma
    tokenizer_ids = http.post("/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    with openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0) as client:
        default = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 and decodes it
        floats = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0
    expected = st_reference(path, tokenizer_ids).numpy()
    assert np.abs(np.asarray(floats.data[1].embedding) - expected).max() < 1e-5
    pooled = http.post("/pooling", json={"input": TEXTS[1]}).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert pooled["data"][0]["data"] == floats.data[1].embedding  # one request alone: the batch's bits


def test_score_and_rerank_are_the_embeddings_cosines_in_vllms_shapes(gemma):
    _, _, http = gemma
    embeddings = [np.asarray(d["embedding"]) for d in http.post("/v1/embeddings", json={"input": TEXTS}).json()["data"]]
    score = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["object"] for d in score["data"]] == ["score", "score"] and score["object"] == "list"
    assert [d["score"] for d in score["data"]] == pytest.approx([embeddings[0] @ e for e in embeddings[1:]], abs=1e-6)
    assert http.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()["data"] == score["data"]
    rerank = http.post("/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}).json()
    best = max(score["data"], key=lambda d: d["score"])
    assert rerank["results"] == [{"index": best["index"], "document": {"text": TEXTS[1 + best["index"]]},
                                  "relevance_score": best["score"]}]
    assert rerank["usage"]["total_tokens"] > 0
    assert len(http.post("/v2/rerank", json={"query": "a", "documents": ["b", "c"]}).json()["results"]) == 2


def test_a_pooling_server_refuses_generation_by_name(gemma):
    _, _, http = gemma
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": []})):
        answer = http.post(path, json=body)
        assert answer.status_code == 400 and "runs a pooling model" in answer.json()["error"]["message"]
    sglang = http.post("/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [1]})
    assert sglang.status_code == 400 and "needs a generation model" in sglang.json()["error"]["message"]
    refused = http.post("/v1/embeddings", json={"input": "a", "dimensions": 8})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"


def test_classify_is_hfs_probabilities_with_the_top_label(tmp_path):
    from transformers import AutoModelForSequenceClassification

    path = write_qwen2_classifier(tmp_path / "cls", 3, id2label={0: "neg", 1: "mid", 2: "pos"})
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[1, 450, 7483, 310], [1, 22172, 29892, 0, 0]]
    with running_server("--api-key", API_KEY, "--num-kv-blocks", "64", model=path) as (base, _):
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
            answer = http.post("/classify", json={"input": prompts}).json()
            refused = http.post("/score", json={"text_1": "a", "text_2": "b"})
    assert answer["object"] == "list" and answer["usage"]["prompt_tokens"] == 9
    for prompt, data in zip(prompts, answer["data"]):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].softmax(-1)
        assert data["num_classes"] == 3 and np.abs(np.asarray(data["probs"]) - expected.numpy()).max() < 1e-5
        assert data["label"] == ["neg", "mid", "pos"][int(expected.argmax())]
    assert refused.status_code == 400 and "this classifier has 3 labels" in refused.json()["error"]["message"]
