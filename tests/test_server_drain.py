"""Draining on SIGTERM (issue 62, a rolling update's stop; coreserve/frontend/server/deploy/drain.py): a SIGTERM to
the server's whole process group (systemd's and a terminal's way) turns /ready and new requests into
503s at once, lets the requests in flight, streamed or not, finish in full, and then the server exits 0
with its core gone; with --shutdown-timeout 0 the requests in flight are answered with an error at once.
A second signal ends the wait; the flag's values. Real servers on loopback, the official openai client.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest
from server_harness import MODEL, core_pids, is_gone, metric_values, running_server

from coreserve.frontend.cli import parser
from coreserve.frontend.server.deploy.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain

NUM_REQUESTS = 6  # every other one streamed
NUM_TOKENS = 48  # long enough for the server to be signalled while each is still generating
ABORTED_TOKENS = 1500  # far more than a run of the test lasts: ended only by the shutdown


def run_request(base: str, index: int, max_tokens: int, first_chunk: threading.Event) -> tuple[str, int]:
    """(finish_reason, completion tokens) of one completion; streamed when `index` is even."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    request = dict(model=MODEL, prompt=f"Request {index}", max_tokens=max_tokens)
    request["extra_body"] = {"ignore_eos": True}
    if index % 2:
        first_chunk.set()
        whole = client.completions.create(**request)
        return whole.choices[0].finish_reason, whole.usage.completion_tokens
    finish_reason, usage = None, None
    for chunk in client.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        first_chunk.set()
        finish_reason = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish_reason)
        usage = chunk.usage or usage
    return finish_reason, usage.completion_tokens


def start_requests(pool: ThreadPoolExecutor, base: str, max_tokens: int) -> list[Future]:
    """NUM_REQUESTS completions, returned once every one is in the engine and each stream has begun."""
    firsts = [threading.Event() for _ in range(NUM_REQUESTS)]
    futures = [pool.submit(run_request, base, i, max_tokens, firsts[i]) for i in range(NUM_REQUESTS)]
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=base, timeout=10) as http:
        while True:
            assert not any(f.done() for f in futures), "a request ended before the signal"
            assert time.monotonic() < deadline, "the requests did not all start"
            values = metric_values(http)
            num_held = values["coreserve:num_requests_running"] + values["coreserve:num_requests_waiting"]
            if all(e.is_set() for e in firsts) and num_held == NUM_REQUESTS:
                return futures
            time.sleep(0.02)


def stop_whole_group(proc) -> list[int]:
    """SIGTERM to the server's process group (its core included, were it in that group); the core pids."""
    cores = core_pids(proc.pid)
    assert cores, "the server spawned no core"
    os.killpg(proc.pid, signal.SIGTERM)
    return cores


def test_sigterm_to_the_group_refuses_new_requests_and_finishes_those_in_flight():
    with running_server("--shutdown-timeout", "30", new_session=True) as (base, proc):
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            futures = start_requests(pool, base, NUM_TOKENS)
            cores = stop_whole_group(proc)
            ready = httpx.get(base + "/ready", timeout=10)
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "shutting_down"
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=10)
            with pytest.raises(openai.InternalServerError) as refused:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
            assert refused.value.status_code == 503 and refused.value.code == "shutting_down"
            assert httpx.get(base + "/health", timeout=10).status_code == 200  # alive while it drains
            answers = [f.result(timeout=60) for f in futures]
        assert answers == [("length", NUM_TOKENS)] * NUM_REQUESTS  # every one answered in full
        assert proc.wait(timeout=30) == 0
        assert all(is_gone(pid) for pid in cores), "the core outlived the server"


def test_shutdown_timeout_0_answers_the_requests_in_flight_with_an_error_at_once():
    with running_server("--shutdown-timeout", "0", new_session=True) as (base, proc):
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            futures = start_requests(pool, base, ABORTED_TOKENS)
            cores = stop_whole_group(proc)
            signalled = time.monotonic()
            errors = [f.exception(timeout=30) for f in futures]
        # none finished, none hangs, none cut: each is told (a 503, or an error event closing its stream)
        assert all(isinstance(e, openai.APIError) for e in errors), errors
        assert not any(isinstance(e, openai.APIConnectionError) for e in errors), errors
        assert all("the engine was shut down" in str(e) for e in errors), errors
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 20
        assert all(is_gone(pid) for pid in cores), "the core outlived the server"


class Requests:
    """Stands for the middleware's count: requests that end when `abort` is called, or never."""

    def __init__(self, drain: Drain, num: int, end_on_abort: bool = True) -> None:
        self.drain, self.end_on_abort, self.num_aborts = drain, end_on_abort, 0
        drain.num_in_flight = num

    def abort(self) -> None:
        self.num_aborts += 1
        if self.end_on_abort:
            self.drain.num_in_flight = 0


def test_a_second_signal_ends_the_wait_and_aborts_what_is_left():
    async def run() -> tuple[float, int]:
        drain = Drain(timeout_s=60)
        requests = Requests(drain, 3)
        task = asyncio.ensure_future(drain.run(requests.abort))
        await asyncio.sleep(0.2)
        assert drain.is_draining and not task.done() and requests.num_aborts == 0
        begun = time.monotonic()
        drain.hurry()
        await asyncio.wait_for(task, 10)
        return time.monotonic() - begun, requests.num_aborts

    seconds, num_aborts = asyncio.run(run())
    assert num_aborts == 1 and seconds < 5


def test_a_drain_with_nothing_in_flight_returns_at_once_without_aborting():
    drain = Drain(timeout_s=60)
    requests = Requests(drain, 0)
    asyncio.run(asyncio.wait_for(drain.run(requests.abort), 5))
    assert drain.is_draining and requests.num_aborts == 0


def test_requests_the_abort_cannot_end_are_left_to_uvicorn_after_the_grace(monkeypatch):
    monkeypatch.setattr("coreserve.frontend.server.deploy.drain.ANSWER_GRACE_S", 0.2)
    drain = Drain(timeout_s=0.1)
    requests = Requests(drain, 2, end_on_abort=False)
    asyncio.run(asyncio.wait_for(drain.run(requests.abort), 5))
    assert requests.num_aborts == 1 and drain.num_in_flight == 2


def test_the_shutdown_timeout_flag_takes_seconds_and_defaults_to_a_drain():
    def timeout(*argv: str) -> float:
        return parser().parse_args(["serve", *argv]).shutdown_timeout

    assert timeout() == DEFAULT_SHUTDOWN_TIMEOUT_S == 30
    assert timeout("--shutdown-timeout", "0") == 0 and timeout("--shutdown-timeout", "2.5") == 2.5
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            timeout("--shutdown-timeout", bad)
