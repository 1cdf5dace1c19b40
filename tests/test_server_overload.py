"""Overload through a real server (issue 39): with --max-queued-requests the server holds at most
max_num_seqs + Q sequences; ten times that offered at once gets 503s with Retry-After past the bound
(the others served whole, nothing lost or timed out), and once the load stops the latency of a lone
request is back to its unloaded value at once, well within 10 s."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest
from server_harness import MODEL, running_server

MAX_NUM_SEQS, MAX_QUEUED = 2, 2
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def base():
    flags = ("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED), "--num-kv-blocks", "64")
    with running_server(*flags) as (url, _):
        yield url


def p50_latency(base: str, count: int = 5) -> float:
    with httpx.Client(base_url=base, timeout=60) as http:
        seconds = []
        for _ in range(count):
            started = time.perf_counter()
            assert http.post("/v1/completions", json=BODY).status_code == 200
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


async def burst(base: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        return await asyncio.gather(*(http.post("/v1/completions", json=BODY) for _ in range(count)))


def test_ten_times_the_bound_gets_503s_with_retry_after_and_the_latency_recovers(base):
    unloaded = p50_latency(base)
    bound = MAX_NUM_SEQS + MAX_QUEUED
    replies = asyncio.run(burst(base, 10 * bound))
    served = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 503]
    assert len(served) + len(refused) == len(replies), sorted({r.status_code for r in replies})
    assert len(served) >= bound and refused  # the bound's worth at least, then refusals
    for reply in refused:
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "overloaded" and reply.json()["error"]["type"] == "server_error"
    assert all(r.json()["usage"]["completion_tokens"] == BODY["max_tokens"] for r in served)
    stopped = time.perf_counter()
    recovered = p50_latency(base)
    assert time.perf_counter() - stopped < 10
    assert recovered <= 1.5 * unloaded + 0.05, (unloaded, recovered)


def test_without_the_flag_nothing_is_refused():
    with running_server("--max-num-seqs", "2", "--num-kv-blocks", "64") as (url, _):
        replies = asyncio.run(burst(url, 12))
    assert [r.status_code for r in replies] == [200] * 12
