"""Two coreserve replicas behind vllm-router against one server with the same cores (issue 42): what the
router costs and what two replicas of one core each give against one engine of two.

    python scripts/bench_router.py                    # SmolLM2 (builtin:smollm2), bench_out/router.json

- throughput: 64 requests of 32 output tokens (greedy, `ignore_eos`, random 64-token prompts), 16 in
  flight, output tokens/s: one server with 2 threads, then two servers with 1 thread each behind
  `vllm-router --policy round_robin`;
- latency the router adds: 40 requests one at a time, 1 output token, straight to one server and
  through a router in front of that same server alone: p50 and p99 of each, and their difference.

Each figure is the median of `--repeats` rounds; the servers are up only while measured.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
from bench_common import machine, median, write_json  # noqa: E402
from server_harness import running_server  # noqa: E402
from test_router import running_router  # noqa: E402

from coreserve.protocol.builtin_model import builtin_model_path  # noqa: E402

NAME = "smollm2"


async def throughput(base: str, count: int, in_flight: int, rng: random.Random) -> float:
    prompts = [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(count)]
    body = {"model": NAME, "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(timeout=None) as http:
        async def one(prompt):
            async with gate:
                response = await http.post(base + "/v1/completions", json={**body, "prompt": prompt})
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return count * 32 / (time.perf_counter() - started)


def latencies(base: str, count: int, rng: random.Random) -> list[float]:
    times = []
    with httpx.Client(timeout=None) as http:
        for _ in range(count):
            prompt = [rng.randrange(1000, 40000) for _ in range(16)]
            started = time.perf_counter()
            http.post(base + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 1}).raise_for_status()
            times.append(time.perf_counter() - started)
    return times


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default="bench_out/router.json")
    args = parser.parse_args()
    path, rng = builtin_model_path("smollm2"), random.Random(0)
    serve = ("--served-model-name", NAME)
    results: dict = {"machine": machine(), "model": "SmolLM2-135M Q4_1"}
    with running_server(*serve, "--num-threads", "2", model=path) as (one, _):
        asyncio.run(throughput(one, 8, 8, rng))  # warm-up
        results["one server, 2 threads: tok/s"] = median(
            [asyncio.run(throughput(one, 64, 16, rng)) for _ in range(args.repeats)])
        direct = [t for _ in range(args.repeats) for t in latencies(one, 40, rng)]
        with running_router(one) as router:
            latencies(router, 5, rng)  # warm-up
            routed = [t for _ in range(args.repeats) for t in latencies(router, 40, rng)]
    for name, values in (("direct", direct), ("through the router", routed)):
        results[f"latency {name} p50 / p99 ms"] = [1e3 * percentile(values, 50), 1e3 * percentile(values, 99)]
    results["router adds p50 / p99 ms"] = [
        1e3 * (percentile(routed, q) - percentile(direct, q)) for q in (50, 99)]
    with running_server(*serve, "--num-threads", "1", model=path) as (a, _), \
            running_server(*serve, "--num-threads", "1", model=path) as (b, _), running_router(a, b) as router:
        asyncio.run(throughput(router, 8, 8, rng))
        results["two replicas of 1 thread behind vllm-router: tok/s"] = median(
            [asyncio.run(throughput(router, 64, 16, rng)) for _ in range(args.repeats)])
    results["two replicas / one server"] = (
        results["two replicas of 1 thread behind vllm-router: tok/s"] / results["one server, 2 threads: tok/s"])
    print(results)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
