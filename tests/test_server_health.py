"""A server's life around its core: -inf logprobs (processed mode) as -9999.0; without a chat template
chat is a 400 that says so; /health turns 503 within 2 s of the core's death and requests get a clear
503; `--core-address` attaches to a daemon."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from conftest import start_daemon
from server_harness import MODEL, core_pids, running_server


@pytest.fixture(scope="module")
def server():
    with running_server("--num-kv-blocks", "128", "--logprobs-mode", "processed") as (base, proc):
        yield base, proc


def test_minus_infinity_is_written_as_minus_9999(server):
    """Processed logprobs put the tokens top_k filtered out at -inf; JSON has no -inf."""
    base, _ = server
    body = {"prompt": "Hi", "max_tokens": 2, "top_k": 2, "logprobs": 5}
    response = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert b"Infinity" not in response.content and b"NaN" not in response.content
    for top in response.json()["choices"][0]["logprobs"]["top_logprobs"]:
        assert sorted(top.values()).count(-9999.0) == 3, top


def test_chat_without_a_template_is_a_400_that_says_so(server):
    base, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(base + "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "chat template" in error["message"]
    assert httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_health_is_503_within_two_seconds_of_the_core_dying(server):
    base, proc = server
    assert httpx.get(base + "/health").status_code == 200
    body = {"prompt": "Hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        os.kill(core_pids(proc.pid)[0], signal.SIGKILL)
        killed_at = time.monotonic()
        rest = [line for line in lines if line]
    assert "engine_dead" in rest[-2] and rest[-1] == "data: [DONE]"  # the open stream is told, then ends
    while httpx.get(base + "/health").status_code != 503:
        assert time.monotonic() - killed_at < 2.0, "/health still says 200"
        time.sleep(0.05)
    response = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    ready = httpx.get(base + "/ready")  # a router's readiness probe says so too
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_dead"
    assert httpx.get(base + "/version").json()["version"]  # what does not need the engine still answers
    assert proc.poll() is None  # the server itself stays up to say so


def test_serve_attaches_to_running_daemons(tiny_path, tmp_path):
    """--core-address repeated: two daemons behind one server, stats summed over both."""
    addresses = [f"ipc://{tmp_path}/core{i}" for i in range(2)]
    daemons = [
        start_daemon(tiny_path, a, "--num-kv-blocks", "64", "--log-level", "WARNING") for a in addresses
    ]
    try:
        with running_server("--core-address", addresses[0], "--core-address", addresses[1]) as (base, _):
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "logprobs": 1}
            result = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
            assert len(result["choices"][0]["logprobs"]["tokens"]) == 3
            assert "coreserve:kv_blocks_total 128.0" in httpx.get(base + "/metrics").text
        assert all(d.poll() is None for d in daemons)  # the daemons outlive the server that attached
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=30)
