"""POST /generate (coreserve/frontend/server/rl/token_generate.py) through a real server on loopback: token ids in,
token ids and logprobs out, equal to /v1/completions given the same ids and parameters; SGLang's
answer shape, one object or a list; the weight version that computed each answer; each bad field a 400
naming it. The 404 without --enable-rl-endpoints and the 401 without the key are test_rl_server.py's."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import load_hf
from server_harness import API_KEY, MODEL, running_server

PROMPTS = [[464, 3139, 286, 4881, 318], [7454, 2402, 257, 640]]  # "The capital of France is", ...


@pytest.fixture(scope="module")
def http():
    with running_server("--enable-rl-endpoints", "--api-key", API_KEY, "--num-kv-blocks", "64") as (base, _):
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            yield client


def completions(http: httpx.Client, prompt: list[int], **fields) -> dict:
    body = {"model": MODEL, "prompt": prompt, "logprobs": 0, "return_token_ids": True, **fields}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def generated(http: httpx.Client, input_ids, **sampling) -> dict | list:
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
    reply = http.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_greedy_ids_and_logprobs_equal_completions_of_the_same_ids(http):
    answers = generated(http, PROMPTS, temperature=0.0, max_new_tokens=8)
    assert isinstance(answers, list) and len(answers) == 2
    for prompt, answer in zip(PROMPTS, answers):
        choice = completions(http, prompt, temperature=0.0, max_tokens=8)
        assert answer["output_ids"] == choice["token_ids"] and len(answer["output_ids"]) == 8
        assert answer["output_token_logprobs"] == choice["logprobs"]["token_logprobs"]
        assert answer["text"] == choice["text"]
        meta = answer["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), 8)


def test_a_seeded_sample_equals_completions_with_the_same_seed(http):
    answer = generated(http, PROMPTS[0], temperature=1.0, max_new_tokens=6, sampling_seed=7)
    assert isinstance(answer, dict)  # one input, n = 1: one object
    choice = completions(http, PROMPTS[0], temperature=1.0, max_tokens=6, seed=7)
    assert answer["output_ids"] == choice["token_ids"]
    assert answer["output_token_logprobs"] == choice["logprobs"]["token_logprobs"]


def test_n_completions_per_input_come_in_input_order(http):
    answers = generated(http, PROMPTS, temperature=1.0, max_new_tokens=3, n=2, sampling_seed=1)
    assert len(answers) == 4
    ids = [a["meta_info"]["id"] for a in answers]
    assert ids[0] == ids[1] != ids[2] == ids[3]
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [5, 5, 4, 4]


def test_a_stop_token_is_the_matched_finish_reason(http):
    first = generated(http, PROMPTS[0], temperature=0.0, max_new_tokens=8)["output_ids"]
    answer = generated(http, PROMPTS[0], temperature=0.0, max_new_tokens=8, stop_token_ids=[first[2]])
    assert answer["output_ids"] == first[:3]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[2]}


def test_without_return_logprob_there_are_no_logprobs(http):
    reply = http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 200, reply.text
    assert "output_token_logprobs" not in reply.json() and len(reply.json()["output_ids"]) == 2


def test_the_weight_version_follows_an_update(http, tiny_path, tmp_path):
    before = generated(http, PROMPTS[0], temperature=0.0, max_new_tokens=2)["meta_info"]["weight_version"]
    load_hf(tiny_path).save_pretrained(str(tmp_path / "same"))
    reply = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "same")})
    assert reply.status_code == 200, reply.text
    after = generated(http, PROMPTS[0], temperature=0.0, max_new_tokens=2)["meta_info"]["weight_version"]
    assert after == before + 1 == reply.json()["weight_version"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "top_n": 3}},
            "sampling_params",
            "top_n",
        ),
        ({"input_ids": [1, 2], "text": "hello"}, "text", "text"),
        ({"input_ids": [[1, 2], [3]], "stream": True}, "stream", "stream"),
        ({"input_ids": [1, 2], "logprobs_mode": "raw_logits"}, "logprobs_mode", "return_logprob"),
        ({"input_ids": []}, "input_ids", "input_ids"),
        ({"input_ids": [1, 10**9]}, "input_ids", "out of vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1.0}}, "sampling_params", "temperature"),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}},
            "sampling_params",
            "max_new_tokens",
        ),
    ],
)
def test_a_bad_field_is_a_400_naming_it(http, body, param, words):
    reply = http.post("/generate", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert generated(http, PROMPTS[1], max_new_tokens=1)["meta_info"]["completion_tokens"] == 1  # serving on


def test_slimes_reading_of_meta_info_and_the_top_logprobs(http):
    """slime reads meta_info.output_token_logprobs as [logprob, token id, text] rows (rollout/sglang_rollout.py)."""
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
            "return_logprob": True, "top_logprobs_num": 3}
    answer = http.post("/generate", json=body).json()
    meta = answer["meta_info"]
    assert [row[1] for row in meta["output_token_logprobs"]] == answer["output_ids"]
    assert [row[0] for row in meta["output_token_logprobs"]] == answer["output_token_logprobs"]
    assert all(len(top) == 3 and top[0][1] == token for top, token in zip(meta["output_top_logprobs"], answer["output_ids"]))
    assert meta["weight_version"] >= 0


def test_slimes_rollout_body_with_top_p_replay(http):
    """The sampling_params slime's GenerateState builds (rollout/sglang_rollout.py: no_stop_trim,
    spaces_between_special_tokens false, custom_params.return_top_p_token_ids when top_p < 1,
    sampling_seed): the same ids and logprobs as /v1/completions with vLLM's names, and
    meta_info.top_p_token_ids / top_p_token_offsets the supports completions' sampling_mask gives."""
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 8, "stop": ["\n\n\n"],
                "stop_token_ids": [50256], "skip_special_tokens": True, "no_stop_trim": True,
                "spaces_between_special_tokens": False, "custom_params": {"return_top_p_token_ids": True},
                "sampling_seed": 11}
    answer = http.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": sampling,
                                          "return_logprob": True}).json()
    choice = completions(http, PROMPTS[0], temperature=1.0, top_p=0.9, top_k=-1, max_tokens=8, stop=["\n\n\n"],
                         stop_token_ids=[50256], include_stop_str_in_output=True,
                         spaces_between_special_tokens=False, seed=11, return_sampling_mask=True)
    assert answer["output_ids"] == choice["token_ids"]
    assert answer["output_token_logprobs"] == choice["logprobs"]["token_logprobs"]
    meta = answer["meta_info"]
    ids, offsets = meta["top_p_token_ids"], meta["top_p_token_offsets"]
    assert len(offsets) == len(answer["output_ids"]) + 1 and offsets[-1] == len(ids)  # slime's own checks
    rows = [ids[offsets[i]:offsets[i + 1]] for i in range(len(answer["output_ids"]))]
    assert rows == choice["sampling_mask"]
    assert all(token in row for token, row in zip(answer["output_ids"], rows))
    bad = http.post("/generate", json={"input_ids": PROMPTS[0],
                                       "sampling_params": {"custom_params": {"other": 1}}})
    assert bad.status_code == 400 and "other" in bad.text


def test_slimes_abort_until_idle_reads_v1_loads(http):
    """slime's abort_server_until_idle (backends/sglang_utils/server_control.py): abort_all, then
    GET /v1/loads?include=core until running + waiting, summed over `loads`, is 0."""
    def in_flight() -> int:
        loads = http.get("/v1/loads", params={"include": "core"}).json()["loads"]
        return sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in loads)

    assert in_flight() == 0
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    rollout = threading.Thread(target=lambda: http.post("/generate", json=body))
    rollout.start()
    deadline = time.monotonic() + 30
    while in_flight() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight() == 1
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    while in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    rollout.join(timeout=30)
    assert in_flight() == 0 and not rollout.is_alive()
    load = http.get("/v1/loads").json()["loads"][0]
    assert 0 <= load["num_used_tokens"] <= load["num_total_tokens"] and load["max_running_requests"] > 0
    gateway = http.get("/v1/loads", params={"include": "core,disagg,queues,memory"})  # sgl-model-gateway's poll
    assert gateway.status_code == 200 and gateway.json()["loads"][0]["num_total_reqs"] == 0
    refused = http.get("/v1/loads", params={"include": "core,gpu"})
    assert refused.status_code == 400 and "gpu" in refused.json()["error"]["message"]


def test_a_stream_is_sglangs_cumulative_chunks(http):
    import json

    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, "return_logprob": True,
            "stream": True}
    chunks = []
    with http.stream("POST", "/generate", json=body) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    whole = generated(http, PROMPTS[1], max_new_tokens=8, temperature=0.0)
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert len(chunks) > 1  # streamed, not one answer in one chunk
    assert all(len(a["output_ids"]) < len(b["output_ids"]) for a, b in zip(chunks, chunks[1:]))  # cumulative
    assert all(a["output_ids"] == b["output_ids"][: len(a["output_ids"])] for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_ends_a_rollout_with_what_it_generated(http):
    import threading
    import time

    result = {}

    def run():
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
                "rid": "rollout-7"}
        result["answer"] = http.post("/generate", json=body, timeout=120).json()

    thread = threading.Thread(target=run)
    thread.start()
    aborted, deadline = [], time.monotonic() + 10
    while http.get("/v1/loads").json()["loads"][0]["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)  # once it runs (and has generated something)
    time.sleep(0.1)
    while not aborted and time.monotonic() < deadline:
        aborted = http.post("/abort_request", json={"abort_all": True}).json()["aborted"]
    thread.join(timeout=60)
    answer = result["answer"]
    assert aborted == ["rollout-7"], answer
    assert answer["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(answer["output_ids"]) < 1000
