"""vLLM's tokens-in, tokens-out endpoint, POST /inference/v1/generate, with requests shaped as prime-rl's
orchestrator sends them (token_ids and vLLM's nested sampling_params; its teacher scoring asks
prompt_logprobs): tokens and logprobs equal to the Python API's bit for bit, streamed or not; the
weight version on every answer; what is not implemented is refused by name."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import running_server

from coreserve import SamplingParams

PROMPT = [464, 3139, 286, 4881, 318, 262, 1388, 1748, 286]
ROLLOUT = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12, "logprobs": 2, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with running_server() as (base, _):
        yield base


def python_api(llm, fields: dict):
    return llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**fields), use_tqdm=False)[0]


def test_a_rollout_equals_the_python_apis_bits(server, llm_inproc):
    answer = httpx.post(server + "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": ROLLOUT},
                        timeout=60).json()
    expected = python_api(llm_inproc, ROLLOUT).outputs[0]
    choice = answer["choices"][0]
    assert choice["token_ids"] == expected.token_ids and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in expected.token_ids]
    assert [c["logprob"] for c in content] == [d[t].logprob for t, d in zip(expected.token_ids, expected.logprobs)]
    assert [[x["logprob"] for x in c["top_logprobs"]] for c in content] == [
        [e.logprob for e in d.values()][:2] for d in expected.logprobs]
    assert answer["weight_version"] == 0 and answer["usage"]["completion_tokens"] == 12


def test_streamed_chunks_add_up_to_the_whole_answer(server):
    """48 tokens: long enough that a loaded host's reader still sees them in several chunks."""
    rollout = {**ROLLOUT, "max_tokens": 48}
    body = {"token_ids": PROMPT, "sampling_params": rollout, "stream": True, "stream_options": {"include_usage": True}}
    token_ids, logprobs, usage, num_chunks = [], [], None, 0
    with httpx.stream("POST", server + "/inference/v1/generate", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            num_chunks += bool(chunk["choices"])
            for choice in chunk["choices"]:
                token_ids += choice["token_ids"]
                logprobs += [c["logprob"] for c in choice["logprobs"]["content"]]
            usage = chunk.get("usage", usage)
    whole = httpx.post(server + "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": rollout},
                       timeout=60).json()["choices"][0]
    assert token_ids == whole["token_ids"] and logprobs == [c["logprob"] for c in whole["logprobs"]["content"]]
    assert num_chunks > 1
    assert usage["completion_tokens"] == 48


def test_teacher_scoring_with_prompt_logprobs(server, llm_inproc):
    fields = {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
    answer = httpx.post(server + "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": fields},
                        timeout=60).json()
    expected = python_api(llm_inproc, fields).prompt_logprobs
    assert len(answer["prompt_logprobs"]) == len(PROMPT) and answer["prompt_logprobs"][0] is None
    for position, entry in enumerate(answer["prompt_logprobs"][1:], start=1):
        assert entry[str(PROMPT[position])]["logprob"] == expected[position][PROMPT[position]].logprob


def test_prime_rls_own_bodies(server, llm_inproc):
    """The bodies prime-rl sends: its rollouts through the renderers client (renderers/client.py
    `generate`, sampling_params built by verifiers/v1/clients/train.py from prime-rl's extra_body: top_k
    -1, min_p 0, return_token_ids, a per-weight-version cache_salt; then stop_token_ids, logprobs 1,
    skip_special_tokens false) and its teacher scoring (prime_rl/utils/client.py `prefill_logprobs`)."""
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "top_k": -1, "min_p": 0.0,
                "return_token_ids": True, "cache_salt": "policy-step-0", "stop_token_ids": [50256],
                "logprobs": 1, "skip_special_tokens": False, "seed": 3}
    body = {"model": "builtin:tiny", "token_ids": PROMPT, "sampling_params": sampling}
    reply = httpx.post(server + "/inference/v1/generate", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    fields = {k: v for k, v in sampling.items() if k != "return_token_ids"}
    expected = python_api(llm_inproc, fields).outputs[0]
    assert choice["token_ids"] == expected.token_ids
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [
        d[t].logprob for t, d in zip(expected.token_ids, expected.logprobs)]
    scoring = {"model": "builtin:tiny", "token_ids": PROMPT,
               "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1}}
    rows = httpx.post(server + "/inference/v1/generate", json=scoring, timeout=60).json()["prompt_logprobs"]
    expected_rows = python_api(llm_inproc, scoring["sampling_params"]).prompt_logprobs
    # prime-rl reads each entry's first value (the prompt token's), 0.0 for the first position
    read = [0.0 if entry is None else next(iter(entry.values()))["logprob"] for entry in rows]
    assert read == [0.0] + [expected_rows[p][PROMPT[p]].logprob for p in range(1, len(PROMPT))]


@pytest.mark.parametrize("body, name", [
    ({"token_ids": PROMPT, "sampling_params": {"use_beam_search": True}}, "use_beam_search"),
    ({"token_ids": PROMPT, "sampling_params": {"priority": 3}}, "priority"),
    ({"token_ids": PROMPT, "sampling_params": {"routed_experts_prompt_start": 3}}, "routed_experts_prompt_start"),
    ({"token_ids": [10**9]}, "token_ids"),
])
def test_what_is_not_implemented_is_refused_by_name(server, body, name):
    response = httpx.post(server + "/inference/v1/generate", json=body, timeout=60)
    assert response.status_code == 400 and name in response.text
