"""coreserve behind an OpenAI router from PyPI (vllm-router, the vLLM project's): two servers on the real
SmolLM2, one thread each, a mixed load of 32 requests with logprobs through the router (some sharing
prefixes, greedy and seeded), every one answered, both replicas serving, and every response's tokens
and logprobs equal, bit for bit, to the same request sent alone to one server with nothing else
running: routing cannot change a result. A replica in another dtype is caught by the same comparison.
The router's view: vLLM's metric names on /metrics with sane values under load, /tokenizer_info.
"""

from __future__ import annotations

import random
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import free_port, running_router_process, running_server

from coreserve.protocol.builtin_model import builtin_model_path

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
MODEL = "smollm2"
STARTS = [  # each longer than a KV block (16 tokens): requests that share one share cached blocks
    "You are a careful assistant. Answer in one short sentence, and never use more words than needed.",
    "def parse(line: str) -> dict:\n    key, _, value = line.partition('=')\n    return {key.strip(): value",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his three daughters",
    "The following is a list of the largest cities in Europe, ordered by population, with their countries:",
]



def workload(count: int, seed: int) -> list[dict]:
    """`count` completions requests: shared starts with their own tails (prefix-cache hits), greedy or
    seeded sampling, 1 to 8 tokens, top-3 logprobs."""
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        prompt = f"{rng.choice(STARTS)} {' '.join(rng.choice(['a', 'red', 'cat', 'x = 1', 'sun']) for _ in range(rng.randint(1, 12)))}"
        sampled = i % 3 == 0
        bodies.append(dict(prompt=prompt, max_tokens=rng.randint(1, 8), logprobs=3,
                           temperature=0.8 if sampled else 0.0, seed=i if sampled else None))
    return bodies


def answer(client: openai.OpenAI, body: dict) -> tuple:
    choice = client.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **body).choices[0]
    lp = choice.logprobs
    return choice.text, lp.tokens, lp.token_logprobs, [sorted(d.items()) for d in lp.top_logprobs]


def running_router(*workers: str):
    port = free_port()
    command = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-urls", *workers, "--log-level", "warning"]
    return running_router_process(command, f"http://127.0.0.1:{port}", "vllm-router")


def metric(base: str, name: str, absent: float | None = None) -> float:
    """The metric's value (summed over its labels); `absent`, where given, for a counter not yet written."""
    text = httpx.get(base + "/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    if not values and absent is not None:
        return absent
    assert values, f"{name} is not on {base}/metrics"
    return sum(values)


def through_router(router: str, bodies: list[dict]) -> list[tuple]:
    with openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda body: answer(client, body), bodies))


def alone(server: str, bodies: list[dict]) -> list[tuple]:
    with openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        return [answer(client, body) for body in bodies]


SERVE = ("--served-model-name", MODEL, "--num-threads", "1")


@pytest.fixture(scope="module")
def first_replica():
    """The fp32 server both router tests put behind the router (each beside its own second replica); a
    test reads its counters' growth over its own requests."""
    with running_server(*SERVE, model=builtin_model_path("smollm2")) as (base, _):
        yield base


def test_two_replicas_behind_vllm_router_answer_with_a_single_servers_bits(first_replica):
    bodies = workload(32, seed=1)
    a, path = first_replica, builtin_model_path("smollm2")
    with running_server(*SERVE, model=path) as (b, _):
        before = [metric(server, "vllm:request_success_total", absent=0.0) for server in (a, b)]
        hits = metric(a, "vllm:prefix_cache_hits_total", absent=0.0)
        with running_router(a, b) as router:
            routed = through_router(router, bodies)
        served = [metric(server, "vllm:request_success_total") - count for server, count in zip((a, b), before)]
        assert all(count >= 8 for count in served) and sum(served) >= 32, served  # both replicas served
        assert metric(a, "vllm:prefix_cache_hits_total") > hits
        assert alone(a, bodies) == routed  # the same bits, whichever replica and neighbours


def test_a_replica_in_another_dtype_is_caught_by_the_comparison(first_replica):
    """The negative control: one replica in bf16 (the same file dequantized to bf16): the requests it
    served differ from the fp32 server's own answers, and the comparison above sees it."""
    bodies = workload(24, seed=2)
    a = first_replica
    with running_server(*SERVE, "--dtype", "bfloat16", model=builtin_model_path("smollm2")) as (b, _):
        with running_router(a, b) as router:
            routed = through_router(router, bodies)
        assert metric(b, "vllm:request_success_total") > 0
        reference = alone(a, bodies)
    assert sum(x != y for x, y in zip(reference, routed)) > 0


def test_vllm_metric_names_and_tokenizer_info_a_router_and_lm_eval_read():
    """Under load (8 requests of 48 tokens in flight): vLLM's gauges, counters and cache info on
    /metrics with sane values; /tokenizer_info in the shape lm-eval's RemoteTokenizer reads."""
    path = builtin_model_path("smollm2")
    with running_server(*SERVE, "--max-num-seqs", "4", model=path) as (base, _):
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300) as client:
            with ThreadPoolExecutor(8) as pool:
                pending = [pool.submit(client.completions.create, model=MODEL, prompt=f"Count {i}:",
                                       max_tokens=48, extra_body={"ignore_eos": True}) for i in range(8)]
                time.sleep(1.5)
                running, waiting = metric(base, "vllm:num_requests_running"), metric(base, "vllm:num_requests_waiting")
                usage = metric(base, "vllm:kv_cache_usage_perc")
                for future in pending:
                    future.result()
        assert 1 <= running <= 4 and running + waiting <= 8 and 0 < usage < 1
        assert metric(base, "vllm:kv_cache_usage_perc") == 0.0  # idle: every block free or the cache's
        assert metric(base, "vllm:generation_tokens_total") == 8 * 48
        assert metric(base, "vllm:num_preemptions_total") == 0  # four sequences fit the KV cache
        text = httpx.get(base + "/metrics").text
        assert re.search(r'^vllm:cache_config_info\{.*block_size="16".*\} 1\.0$', text, re.M)
        assert 'model_name="smollm2"' in text
        info = httpx.get(base + "/tokenizer_info").json()
        assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
        assert info["model_max_length"] == httpx.get(base + "/v1/models").json()["data"][0]["max_model_len"]
        tokens = httpx.post(base + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
        assert httpx.post(base + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
