"""The server around the endpoints: API key (401), unknown model (404), malformed bodies, /v1/models,
/tokenize, /detokenize, /metrics, clients that disconnect, and many concurrent streams."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import PROMPTS
from server_harness import API_KEY, MODEL, metric_values, running_server, wait_until_idle

NUM_KV_BLOCKS = 1024


@pytest.fixture(scope="module")
def server():
    flags = ["--api-key", API_KEY, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "256"]
    with running_server(*flags) as (base, _):
        yield base


def test_a_missing_or_wrong_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        body = {"model": MODEL, "prompt": "Hi"}
        response = httpx.post(server + "/v1/completions", json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0) as bad_client:
        with pytest.raises(openai.AuthenticationError):
            bad_client.models.list()


def test_an_unknown_model_is_404_and_the_next_request_succeeds(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices[0].finish_reason


def test_bodies_that_are_not_json_or_not_finite_are_400(http):
    headers = {"content-type": "application/json"}
    response = http.post("/v1/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    body = b'{"model": "builtin:tiny", "prompt": "Hi", "temperature": NaN}'
    response = http.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    body = b'{"model": "builtin:tiny", "prompt": "\\ud800"}'  # a lone surrogate: valid JSON, not text
    response = http.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert http.post("/v1/nowhere", json={}).json()["error"]["message"] == "Not Found"
    form = http.post("/v1/completions", content=b'{"prompt": "Hi"}', headers={"content-type": "text/plain"})
    assert form.status_code == 400 and "Content-Type: application/json" in form.json()["error"]["message"]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_tokenize_and_detokenize_round_trip(http, tokenizer):
    tokens = http.post("/tokenize", json={"prompt": PROMPTS[1]}).json()
    assert tokens["tokens"] == tokenizer(PROMPTS[1]).input_ids and tokens["count"] == len(tokens["tokens"])
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPTS[1]}
    strs = http.post("/tokenize", json={"prompt": PROMPTS[1], "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs) == PROMPTS[1] and tokens["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": [10**9]}).json()["error"]["param"] == "tokens"


def test_metrics_count_tokens_and_show_the_kv_cache(http, client):
    before = metric_values(http)
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    after = metric_values(http)
    assert after["coreserve:generation_tokens_total"] - before["coreserve:generation_tokens_total"] == 5
    assert after["coreserve:prompt_tokens_total"] - before["coreserve:prompt_tokens_total"] == 5
    assert after["coreserve:kv_blocks_total"] == NUM_KV_BLOCKS
    assert after["coreserve:num_requests_running"] == after["coreserve:num_requests_waiting"] == 0
    ttft = "coreserve:time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert after["coreserve:time_per_output_token_seconds_count"] >= 1


def test_metrics_count_prefix_cache_queries_and_hits(http, client):
    prompt = "A system prompt long enough to fill more than one cache block of sixteen tokens, surely. " * 2
    before = metric_values(http)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = metric_values(http)
    queries = after["coreserve:prefix_cache_queries_total"] - before["coreserve:prefix_cache_queries_total"]
    hits = after["coreserve:prefix_cache_hits_total"] - before["coreserve:prefix_cache_hits_total"]
    assert queries >= 2 * 32 and hits >= 32  # the second request read the first one's blocks
    assert after["coreserve:prefix_cache_blocks"] >= 2


def test_a_stream_dropped_midway_frees_its_blocks(http, server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric_values(http)["coreserve:num_requests_running"] == 1
    assert wait_until_idle(http)


def test_a_non_streamed_request_whose_client_leaves_is_aborted(http, server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=1.0)
    assert wait_until_idle(http)


def test_256_concurrent_streams_finish_with_their_counts_while_bad_requests_are_refused(server, http):
    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPTS[i % len(PROMPTS)],
            max_tokens=3 + i % 5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens

    async def bad(client, i):
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt=[50257 + i], max_tokens=2, stream=i % 2 == 0)

    async def main():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0) as client:
            refusals = [bad(client, i) for i in range(16)]
            return (await asyncio.gather(*(one(client, i) for i in range(256)), *refusals))[:256]

    assert asyncio.run(main()) == [3 + i % 5 for i in range(256)]
    assert wait_until_idle(http)
