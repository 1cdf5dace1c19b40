"""Requests pinned to a weight version (`SamplingParams(weight_version=V)`, slime's pinned rollouts): one
pinned to the engine's version runs; one pinned to another fails at arrival naming weight_version; an
update landing while a pinned request runs under mode "keep" ends it with that error; unpinned requests
run on whatever weights are there."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from coreserve import LLM, SamplingParams
from coreserve.frontend.errors import RequestFailedError


def test_pinned_requests_run_on_their_version_and_fail_on_another(tiny_path):
    checkpoint = str(Path(tiny_path) / "model.safetensors")
    with LLM(tiny_path, multiprocess=False) as llm:
        assert llm.generate(["Hi"], SamplingParams(max_tokens=2, weight_version=0), use_tqdm=False)
        with pytest.raises(RequestFailedError, match="weight_version"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, weight_version=1), use_tqdm=False)
        assert llm.update_weights(checkpoint) == 1
        assert llm.generate(["Hi"], SamplingParams(max_tokens=2, weight_version=1), use_tqdm=False)
        with pytest.raises(RequestFailedError, match="pinned to weights 0"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, weight_version=0), use_tqdm=False)
        assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].weight_version == 1


def test_an_update_under_keep_ends_a_request_pinned_to_the_old_weights(tiny_path):
    """Through the server (a rollout and an update at once): slime's /generate pinned to version 0."""
    import time

    import httpx
    from server_harness import running_server

    checkpoint = str(Path(tiny_path) / "model.safetensors")
    with running_server("--enable-rl-endpoints") as (base, _), httpx.Client(base_url=base, timeout=120) as http:
        result = {}

        def rollout():
            body = {"input_ids": [464, 3139], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
                    "weight_version": 0}
            result["reply"] = http.post("/generate", json=body)

        thread = threading.Thread(target=rollout)
        thread.start()
        deadline = time.monotonic() + 10
        while "num_requests_running 1.0" not in http.get("/metrics").text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "num_requests_running 1.0" in http.get("/metrics").text  # ended mid-way, not refused at arrival
        update = http.post("/update_weights_from_disk", json={"model_path": checkpoint, "mode": "keep"})
        assert update.json()["weight_version"] == 1, update.text
        thread.join(timeout=60)
        reply = result["reply"]
        assert reply.status_code == 409 and "pinned to weights 0, the engine holds 1" in reply.text, reply.text
        pinned_new = {"input_ids": [464], "sampling_params": {"max_new_tokens": 2}, "weight_version": 1}
        assert http.post("/generate", json=pinned_new).json()["meta_info"]["weight_version"] == 1
