"""What one heavy request may cost the server (issue 20): a body over --max-request-bytes is a 413 before
it is read, a prompt that cannot fit the context is a 400 before it is tokenized, a prompt that must be
tokenized is tokenized off the event loop; meanwhile other clients keep their latency and the server's
memory stays put. The official openai client against a real `python -m coreserve serve`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import MODEL, chat_template_file, latencies_while, running_server

MAX_REQUEST_BYTES = 2_000_000
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    flags = ["--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-model-len", str(MAX_MODEL_LEN)]
    flags += ["--chat-template", chat_template_file(tmp_path_factory)]
    with running_server(*flags, "--num-kv-blocks", "256") as (base, proc):
        yield base, proc


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def huge_stream(num_bytes: int, piece: int = 1_000_000):
    """A chunked body (no Content-Length) of `num_bytes`: the server must count as it reads."""
    yield b'{"model": "builtin:tiny", "prompt": "'
    for _ in range(num_bytes // piece):
        yield b"x" * piece
    yield b'"}'


def test_a_body_over_the_limit_is_a_413_in_openai_shape(client, server):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="word " * 6_000_000, max_tokens=1)
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
    assert "--max-request-bytes" in info.value.body["message"]
    response = httpx.post(
        server + "/v1/completions",
        content=huge_stream(20_000_000),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(client):
    """1.5 MB of text has at least 1.5 MB / (4 x 128 bytes) ~ 2900 tokens: more than 512, untokenized."""
    started = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="word " * 300_000, max_tokens=1)
    assert info.value.body["param"] == "prompt" and "at least" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 300_000}], max_tokens=1
        )
    assert info.value.body["param"] == "messages" and "at least" in info.value.body["message"]
    assert time.perf_counter() - started < 5  # tokenizing 3 MB of text takes several seconds here


def test_a_long_prompt_to_truncate_is_tokenized_and_served(client):
    result = client.completions.create(
        model=MODEL, prompt="word " * 100_000, max_tokens=2, extra_body={"truncate_prompt_tokens": 50}
    )
    assert result.usage.prompt_tokens == 50 and result.usage.completion_tokens == 2


def _hammer(server: str, stop: threading.Event, errors: list) -> None:
    """Huge requests, one after another: declared too large, streamed too large, and unfit."""
    bodies = [{"model": MODEL, "prompt": "word " * 6_000_000}, {"model": MODEL, "prompt": "word " * 300_000}]
    with httpx.Client(base_url=server, timeout=120) as http:
        while not stop.is_set():
            try:
                statuses = [http.post("/v1/completions", json=body).status_code for body in bodies]
                stream = http.post(
                    "/v1/completions",
                    content=huge_stream(20_000_000),
                    headers={"content-type": "application/json"},
                )
                statuses.append(stream.status_code)
                assert statuses == [413, 400, 413], statuses
            except Exception as exc:  # reported by the test thread
                errors.append(exc)
                return


def probe_latencies(client, duration_s: float, errors: list) -> list[float]:
    latencies = []
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline and not errors:
        started = time.perf_counter()
        result = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4)
        latencies.append(time.perf_counter() - started)
        assert result.usage.completion_tokens == 4
    return latencies


def test_normal_requests_keep_their_latency_while_huge_ones_are_refused(client, served):
    """Under 1 s each on a quiet machine; the bound adds the slowest of the same requests alone just
    before, so that other load on a shared machine does not fail it (a stall of tokenizing a huge
    prompt on the event loop is tens of seconds)."""
    server, proc = served
    alone = probe_latencies(client, 3, [])
    rss_before = rss_mib(proc.pid)
    stop, errors = threading.Event(), []
    hammer = threading.Thread(target=_hammer, args=(server, stop, errors))
    hammer.start()
    try:
        latencies = probe_latencies(client, 12, errors)
    finally:
        stop.set()
        hammer.join(timeout=120)
    assert not errors, errors
    assert len(latencies) > 5 and max(latencies) < 1.0 + max(alone), (sorted(latencies)[-5:], max(alone))
    growth = rss_mib(proc.pid) - rss_before
    assert growth < 100, f"the server grew by {growth:.0f} MiB"


def test_tokenizing_a_long_prompt_never_blocks_the_event_loop(server):
    """A 1.9 MB prompt to truncate must be tokenized (seconds of work): /health answers all the while."""
    body = {"model": MODEL, "prompt": "word " * 380_000, "max_tokens": 1, "truncate_prompt_tokens": 8}
    status, seconds, health = latencies_while(
        server, lambda: httpx.post(server + "/v1/completions", json=body, timeout=120).status_code
    )
    assert status == 200 and seconds > 0.5, seconds  # there was work to block on
    assert max(health) < seconds / 2, (max(health), seconds)
