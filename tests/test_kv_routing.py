"""Two coreserve servers on the real SmolLM2 (one thread each, KV-cache events on) as the routers people
deploy see them:
- kv_aware-style routing: a client subscribed to both servers' events (tests/kv_subscriber.py) sends
  each request of a shared-system-prompt workload to the server whose events hold its longest prefix
  (llm-d's keys); the prompt tokens the servers report read from their caches reach >= 0.9 of the ideal
  (one cache that had seen every earlier request), both servers serve, and every answer equals, bit for
  bit, the same request sent alone to one server;
- SGLang's gateway (sgl-model-gateway, PyPI's sglang-router; its default cache_aware policy) in front of
  the same two: every request answered, both serving, every answer the one server's alone; the gateway
  reads the servers' /server_info, /model_info and /get_load (deploy/router_probes.py).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from kv_subscriber import Subscriber
from server_harness import free_port, running_router_process, running_server
from test_router import answer, metric

from coreserve.protocol.builtin_model import builtin_model_path

MODEL, BLOCK = "smollm2", 16
GATEWAY = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
SYSTEMS = [  # four system prompts of 60 to 80 tokens, shared by the requests that name them
    "You are a patient teacher of chemistry. Explain each idea with one everyday example, define every term "
    "the first time you use it, and finish with a one-line summary the student can remember.",
    "You are a senior Python reviewer. Point out bugs first, then style; quote the line you mean, suggest "
    "the smallest change that fixes it, and never rewrite code that already works as intended.",
    "You are a travel planner for families with small children. Prefer short journeys, name one place to "
    "eat near each stop, and warn about anything that needs booking weeks ahead of the trip.",
    "You are a careful translator from French to English. Keep the register of the original, mark idioms "
    "you could not carry over, and give the literal meaning in brackets after each of them.",
]
QUESTIONS = ["What is the first step?", "Why does that work?", "Give me one more example.", "Summarise it.",
             "What should I avoid?", "How long will it take?", "Is there a cheaper way?", "What comes next?"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """{topic: (url, events endpoint)} for two servers publishing their KV-cache events (replay beside)."""
    folder, path = tmp_path_factory.mktemp("kv"), builtin_model_path(MODEL)
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in ("a", "b"):
            topic, endpoint = f"kv@pod-{name}@{MODEL}", f"ipc://{folder}/events-{name}"
            events = (f'{{"enable_kv_cache_events": true, "endpoint": "{endpoint}", "topic": "{topic}", '
                      f'"replay_endpoint": "{endpoint}-replay"}}')
            url, _ = stack.enter_context(running_server(
                "--served-model-name", MODEL, "--num-threads", "1", "--kv-events-config", events,
                "--enable-prompt-tokens-details", model=path))
            servers[topic] = (url, endpoint)
        yield servers


def body_of(system: str, question: str) -> dict:
    return dict(prompt=f"{system}\nQuestion: {question}\nAnswer:", max_tokens=6, logprobs=3, temperature=0.0)


def ideal_hits(prompts: list[list[int]]) -> int:
    """Prompt tokens one cache that kept everything would have read: each prompt's longest prefix shared
    with an earlier one, in full blocks, never its last token."""
    total = 0
    for i, ids in enumerate(prompts):
        shared = max((_common(ids, earlier) for earlier in prompts[:i]), default=0)
        total += min(shared, len(ids) - 1) // BLOCK * BLOCK
    return total


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_routing_by_the_events_longest_prefix_finds_the_ideal_hits(replicas):
    rng = random.Random(5)
    bodies = [body_of(rng.choice(SYSTEMS), rng.choice(QUESTIONS)) for _ in range(32)]
    urls = {topic: url for topic, (url, _) in replicas.items()}
    subscriber = Subscriber({topic: endpoint for topic, (_, endpoint) in replicas.items()}, model=MODEL,
                            replays={topic: endpoint + "-replay" for topic, (_, endpoint) in replicas.items()})
    time.sleep(0.3)  # the SUB sockets' subscriptions reach the publishers
    served = dict.fromkeys(urls, 0)
    prompts, cached, routed = [], 0, []
    with subscriber:
        for body in bodies:
            ids = httpx.post(urls[next(iter(urls))] + "/tokenize", json={"prompt": body["prompt"]}).json()["tokens"]
            prompts.append(ids)
            scores = {topic: subscriber.views[topic].hit_blocks(ids, BLOCK) for topic in urls}
            best = max(scores.values())  # the longest prefix; among equals, the server that served fewer
            topic = min((t for t in urls if scores[t] == best), key=lambda t: served[t])
            served[topic] += 1
            with openai.OpenAI(base_url=urls[topic] + "/v1", api_key="none", max_retries=0) as client:
                response = client.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **body)
            details = response.usage.prompt_tokens_details
            cached += details.cached_tokens if details else 0
            routed.append(_answer_of(response.choices[0]))
            subscriber.drain(0.05)
    ideal = ideal_hits(prompts)
    print(f"prompt tokens read from the caches: {cached} of the ideal {ideal}; requests served: {served}")
    assert ideal > 0 and cached >= 0.9 * ideal, (cached, ideal)
    assert min(served.values()) >= 6, served  # both serve: new system prompts go to the one with fewer
    with openai.OpenAI(base_url=urls[f"kv@pod-a@{MODEL}"] + "/v1", api_key="none", max_retries=0) as client:
        assert [answer(client, body) for body in bodies] == routed  # one server alone: the same bits


def _answer_of(choice) -> tuple:
    lp = choice.logprobs
    return choice.text, lp.tokens, lp.token_logprobs, [sorted(d.items()) for d in lp.top_logprobs]


def running_gateway(*workers: str):
    port = free_port()
    command = [GATEWAY, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--log-level", "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return running_router_process(command, f"http://127.0.0.1:{port}", "the gateway")


def test_behind_sglangs_gateway_every_answer_is_one_servers_alone(replicas):
    rng = random.Random(6)
    bodies = [body_of(rng.choice(SYSTEMS), rng.choice(QUESTIONS)) for _ in range(24)]
    for i, body in enumerate(bodies):  # seeded sampling too: a seed's tokens do not depend on the replica
        if i % 3 == 0:
            body.update(temperature=0.8, seed=i)
    urls = [url for url, _ in replicas.values()]
    before = [metric(url, "vllm:request_success_total") for url in urls]
    with running_gateway(*urls) as gateway:
        workers = httpx.get(gateway + "/workers").json()["workers"]
        assert {w["model_id"] for w in workers} == {MODEL} and len(workers) == 2  # from /server_info, /model_info
        with openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0, timeout=300) as client:
            with ThreadPoolExecutor(8) as pool:
                through = list(pool.map(lambda body: answer(client, body), bodies))
        loads = httpx.get(gateway + "/get_loads").json()["workers"]
        assert len(loads) == 2 and all(load["load"] >= 0 for load in loads)  # each server's /get_load read
    served = [metric(url, "vllm:request_success_total") - b for url, b in zip(urls, before)]
    assert sum(served) == len(bodies) and min(served) >= 4, served
    with openai.OpenAI(base_url=urls[0] + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        assert [answer(client, body) for body in bodies] == through
