"""The RL control endpoints (coreserve/frontend/server/rl/control.py) through a real server on loopback: a 404
without --enable-rl-endpoints, a 401 without the API key, and with both: new weights from a checkpoint
folder (the logprobs become HF's on them, the version advances; a bad one is a 400 that changes
nothing), pause and resume, sleep and wake."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from conftest import HF_TOLERANCE, load_hf
from server_harness import API_KEY, MODEL, running_server

PROMPT = "The capital of France is Paris. The capital of Germany is"
SCORE = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 0}
ENDPOINTS = [("POST", "/update_weights_from_disk"), ("POST", "/update_weights"), ("POST", "/reset_prefix_cache"), ("POST", "/pause"),
             ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/sleep"), ("POST", "/wake_up"),
             ("GET", "/is_sleeping"), ("GET", "/get_weight_version"), ("POST", "/generate"),
             ("POST", "/get_sequence_logprobs/"), ("POST", "/pause_generation"), ("GET", "/flush_cache"),
             ("POST", "/release_memory_occupation")]


@pytest.fixture(scope="module")
def http():
    with running_server("--enable-rl-endpoints", "--api-key", API_KEY, "--num-kv-blocks", "64") as (base, _):
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            yield client


def checkpoint(tiny_path: str, folder, seed: int) -> tuple[str, object]:
    """The tiny model's weights, each perturbed, saved as an HF folder; returns (folder, the HF model)."""
    model = load_hf(tiny_path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.2 * param.abs().mean())
    model.save_pretrained(str(folder))
    return str(folder), model


def scored(http: httpx.Client) -> torch.Tensor:
    """The server's logprob of each prompt token after the first."""
    reply = http.post("/v1/completions", json=SCORE)
    assert reply.status_code == 200, reply.text
    return torch.tensor(reply.json()["choices"][0]["logprobs"]["token_logprobs"][1:-1], dtype=torch.float64)


def hf_scored(model, http: httpx.Client) -> torch.Tensor:
    token_ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids[1:]).unsqueeze(1))[:, 0]


def version(http: httpx.Client) -> int:
    return http.get("/get_weight_version").json()["weight_version"]


def test_rl_endpoints_are_a_404_without_the_flag():
    with running_server("--api-key", API_KEY, "--num-kv-blocks", "16") as (base, _):
        headers = {"Authorization": f"Bearer {API_KEY}"}
        for method, path in ENDPOINTS:
            assert httpx.request(method, base + path, headers=headers).status_code == 404, path
        assert httpx.get(base + "/v1/models", headers=headers).status_code == 200


def test_rl_endpoints_are_a_401_without_the_api_key(http):
    for method, path in ENDPOINTS:
        assert httpx.request(method, f"{http.base_url}{path}").status_code == 401, path
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.request(method, f"{http.base_url}{path}", headers=wrong).status_code == 401, path
    assert http.get("/is_sleeping").json()["is_sleeping"] is False  # nothing above reached the engine


def test_update_weights_from_disk_serves_the_checkpoint_and_advances_the_version(http, tiny_path, tmp_path):
    before, old_version = scored(http), version(http)
    folder, model = checkpoint(tiny_path, tmp_path / "ckpt", seed=3)
    reply = http.post("/update_weights_from_disk", json={"model_path": folder})
    assert reply.status_code == 200, reply.text
    assert reply.json()["success"] is True
    assert reply.json()["weight_version"] == version(http) == old_version + 1
    after = scored(http)
    assert (after - before).abs().max() > 1e-3
    assert torch.allclose(after, hf_scored(model, http), atol=HF_TOLERANCE)


def test_a_bad_update_is_a_400_naming_the_field_and_the_old_weights_keep_serving(http, tmp_path):
    before, old_version = scored(http), version(http)
    missing = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model_path"
    from safetensors.torch import save_file

    bad = str(tmp_path / "bad.safetensors")
    save_file({"model.layers.0.mlp.up_proj.weight": torch.ones(2, 2)}, bad)
    mismatched = http.post("/update_weights_from_disk", json={"model_path": bad})
    assert mismatched.status_code == 400 and "up_proj" in mismatched.json()["error"]["message"]
    unknown = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "flush": True})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "flush"
    assert version(http) == old_version
    assert torch.equal(scored(http), before)


def test_prime_rls_filesystem_broadcast(http, tiny_path, tmp_path):
    """prime-rl's watcher (orchestrator, utils/client.py `update_weights`): the trainer's step folder with
    its STABLE marker, then /pause?mode=keep&clear_cache=false, the NCCL_READY marker, /update_weights
    {"weight_dir"}, /resume. A rollout sent around the pause finishes after it; the new weights serve."""
    old_version = version(http)
    weight_dir = tmp_path / "broadcasts" / "step_1"
    folder, model = checkpoint(tiny_path, weight_dir, seed=5)
    (weight_dir / "STABLE").touch()
    replies = []
    long = {**SCORE, "echo": False, "max_tokens": 64, "ignore_eos": True}
    rollout = threading.Thread(target=lambda: replies.append(http.post("/v1/completions", json=long)))
    rollout.start()
    assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    (weight_dir / "NCCL_READY").touch()
    reply = http.post("/update_weights", json={"weight_dir": folder})
    assert reply.status_code == 200 and reply.json()["weight_version"] == old_version + 1, reply.text
    assert http.post("/resume").status_code == 200
    rollout.join(timeout=60)
    assert replies[0].status_code == 200 and len(replies[0].json()["choices"][0]["text"]) > 0
    assert torch.allclose(scored(http), hf_scored(model, http), atol=HF_TOLERANCE)
    bad = http.post("/update_weights", json={"weight_dir": str(tmp_path / "nowhere")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "weight_dir"
    assert version(http) == old_version + 1


def test_slimes_weight_sync_and_memory_calls(http, tiny_path, tmp_path):
    """slime's SGLangEngine calls (backends/sglang_utils/sglang_engine.py): pause_generation, GET
    flush_cache, update_weights_from_disk with the trainer's weight_version (a string), continue;
    release and resume memory occupation around training; a request pinned to the new version runs."""
    folder, model = checkpoint(tiny_path, tmp_path / "slime", seed=9)
    assert http.post("/pause_generation", json={}).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.get("/flush_cache").status_code == 200
    reply = http.post("/update_weights_from_disk", json={"model_path": folder, "weight_version": "7"})
    assert reply.status_code == 200 and reply.json()["weight_version"] == 7, reply.text
    assert http.post("/continue_generation", json={}).status_code == 200
    assert version(http) == 7 and http.get("/is_paused").json() == {"is_paused": False}
    assert torch.allclose(scored(http), hf_scored(model, http), atol=HF_TOLERANCE)
    pinned = http.post("/generate", json={"input_ids": [464, 3139], "weight_version": 7,
                                          "sampling_params": {"max_new_tokens": 2}})
    assert pinned.status_code == 200 and pinned.json()["meta_info"]["weight_version"] == 7
    assert http.post("/release_memory_occupation", json={}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "level": 1}  # the weights stay
    assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    stale = http.post("/generate", json={"input_ids": [464, 3139], "weight_version": 3,
                                         "sampling_params": {"max_new_tokens": 2}})
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "weight_version_mismatch"
    second, model = checkpoint(tiny_path, tmp_path / "slime-2", seed=10)  # other weights: the update shows
    again = http.post("/update_weights_from_disk", json={"model_path": second, "weight_version": "8"})
    assert again.status_code == 200, again.text
    assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert http.get("/is_sleeping").json()["is_sleeping"] is False and version(http) == 8
    assert torch.allclose(scored(http), hf_scored(model, http), atol=HF_TOLERANCE)
    for body, param in [({"model_path": folder, "weight_version": "v2"}, "weight_version"),
                        ({"model_path": folder, "load_format": "dummy"}, "load_format")]:
        refused = http.post("/update_weights_from_disk", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def test_pause_holds_new_requests_until_resume(http):
    assert http.post("/pause", params={"mode": "bogus"}).json()["error"]["param"] == "mode"
    assert http.get("/ready").json() == {"status": "ready"}
    assert http.post("/pause", params={"mode": "abort"}).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    not_ready = http.get("/ready")  # a router's readiness probe sends elsewhere while paused
    assert not_ready.status_code == 503 and "paused" in not_ready.json()["error"]["message"]
    replies = []
    def wait_for_completion() -> None:  # on a connection of its own: the main client's stays free for /resume
        with httpx.Client(base_url=http.base_url, headers=http.headers, timeout=60) as own:
            replies.append(own.post("/v1/completions", json=SCORE))

    waiter = threading.Thread(target=wait_for_completion)
    waiter.start()
    waiter.join(timeout=2.0)
    assert waiter.is_alive() and not replies  # accepted, waiting in the queue
    assert http.post("/resume").status_code == 200
    waiter.join(timeout=60)
    assert replies[0].status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": False} and http.get("/ready").status_code == 200


def test_sleep_and_wake_up_levels_one_and_two(http, tiny_path, tmp_path):
    assert http.post("/sleep", params={"level": 3}).json()["error"]["param"] == "level"
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "level": 1}
    assert http.get("/ready").status_code == 503 and "asleep" in http.get("/ready").text
    assert http.post("/wake_up").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False, "level": 0}
    scored(http)

    folder, model = checkpoint(tiny_path, tmp_path / "ckpt", seed=4)
    old_version = version(http)
    assert http.post("/sleep", params={"level": 2}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "level": 2}
    refused = http.post("/wake_up", params={"tags": ["weights"]})  # the weights are gone: a path is needed
    assert refused.status_code == 400, refused.text
    reply = http.post("/wake_up", params={"tags": ["weights", "kv_cache"], "model_path": folder})
    assert reply.status_code == 200, reply.text
    assert http.get("/is_sleeping").json() == {"is_sleeping": False, "level": 0}
    assert version(http) == old_version + 1
    assert torch.allclose(scored(http), hf_scored(model, http), atol=HF_TOLERANCE)
    assert http.post("/reset_prefix_cache").status_code == 200
