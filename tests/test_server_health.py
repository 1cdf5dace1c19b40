"""A server without a chat template, and a server whose core dies: chat is a 400 that says there is no
template; /health turns 503 within 2 s of the core's death, and requests get a clear 503."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL, running_server


@pytest.fixture(scope="module")
def server():
    with running_server("--num-kv-blocks", "128") as (base, proc):
        yield base, proc


def test_chat_without_a_template_is_a_400_that_says_so(server):
    base, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(base + "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "chat template" in error["message"]
    assert httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def core_pid(server_pid: int) -> int:
    """The `python -m engine_core` child the server spawned."""
    for child in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        if b"engine_core" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError("the server has no engine_core child")


def test_health_is_503_within_two_seconds_of_the_core_dying(server):
    base, proc = server
    assert httpx.get(base + "/health").status_code == 200
    os.kill(core_pid(proc.pid), signal.SIGKILL)
    killed_at = time.monotonic()
    while httpx.get(base + "/health").status_code != 503:
        assert time.monotonic() - killed_at < 2.0, "/health still says 200"
        time.sleep(0.05)
    response = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    assert proc.poll() is None  # the server itself stays up to say so
