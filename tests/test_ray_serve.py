"""coreserve on Ray Serve (coreserve/frontend/server/deploy/ray_serve.py): a local Ray cluster (`ray start --head` on
127.0.0.1 inside the test, stopped at the end) deploying two replicas of the built-in tiny model behind
Ray Serve's prefix-affinity router. The official openai client gets answers equal, bit for bit, to one
`coreserve serve` alone; `/update_weights` moves every replica's weight_version together, and a
checkpoint that does not fit leaves every replica on the old weights. The ingress's update (the
several-daemon frontend's policy, `update_all_or_none`) on stand-in replicas, one refusing, needs no cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from server_harness import free_port, running_server

from coreserve.protocol.builtin_model import builtin_model_path

RAY = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
NAME = "tiny"


@pytest.fixture(scope="module")
def ray_app():
    import ray
    from ray import serve

    from coreserve.frontend.server.deploy.ray_serve import build_ray_app

    port, http_port = free_port(), free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    start = [RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "3",
             "--include-dashboard", "false", "--disable-usage-stats"]
    subprocess.run(start, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    try:
        ray.init(address=f"127.0.0.1:{port}", logging_level="WARNING")
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        engine_args = {"num_threads": 1, "num_kv_blocks": 256}
        serve.run(build_ray_app(builtin_model_path("tiny"), 2, engine_args, NAME), name="coreserve", route_prefix="/")
        yield f"http://127.0.0.1:{http_port}"
    finally:
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            subprocess.run([RAY, "stop", "--force"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=120)


def requests(count: int) -> list[dict]:
    rng = random.Random(4)
    shared = "The meaning of a long shared prefix that several requests start with is "
    return [dict(prompt=shared * rng.randint(1, 3) + str(i), max_tokens=rng.randint(2, 8), logprobs=3,
                 temperature=0.7 if i % 2 else 0.0, seed=i) for i in range(count)]


def answers(base: str, bodies: list[dict]) -> list[tuple]:
    with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120) as client:
        out = []
        for body in bodies:
            choice = client.completions.create(model=NAME, extra_body={"ignore_eos": True}, **body).choices[0]
            out.append((choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs))
        return out


def test_two_replicas_answer_with_a_single_servers_bits(ray_app):
    bodies = requests(16)
    served = answers(ray_app, bodies)
    chat = httpx.post(ray_app + "/v1/chat/completions", timeout=60,
                      json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 400 and "chat template" in chat.text  # the replica's own 400, forwarded whole
    assert httpx.post(ray_app + "/v1/completions", json={"model": NAME, "prompt": "x", "stream": True}).status_code == 400
    with running_server("--served-model-name", NAME, model=builtin_model_path("tiny")) as (base, _):
        assert answers(base, bodies) == served


def test_update_weights_moves_every_replica_or_none(ray_app, tmp_path):
    from safetensors.numpy import load_file, save_file

    before = answers(ray_app, requests(4))
    weights = load_file(str(Path(builtin_model_path("tiny")) / "model.safetensors"))
    changed = tmp_path / "changed.safetensors"  # the final norm scaled: other logprobs everywhere
    save_file({"model.norm.weight": weights["model.norm.weight"] * 1.5}, str(changed))
    reply = httpx.post(ray_app + "/update_weights", json={"model_path": str(changed)}, timeout=120)
    assert reply.status_code == 200, reply.text
    after = answers(ray_app, requests(4))
    assert all(a[1] != b[1] for a, b in zip(after, before))  # every request sees the new weights
    assert httpx.get(ray_app + "/get_weight_version").json() == {"weight_version": 1, "replicas": [1, 1]}
    bad = tmp_path / "bad.safetensors"
    save_file({"model.norm.weight": np.zeros(7, dtype=np.float32)}, str(bad))  # the wrong shape
    reply = httpx.post(ray_app + "/update_weights", json={"model_path": str(bad)}, timeout=120)
    assert reply.status_code == 400 and "refused" in reply.json()["error"]["message"]
    assert httpx.get(ray_app + "/get_weight_version").json() == {"weight_version": 1, "replicas": [1, 1]}
    assert httpx.post(ray_app + "/reset_prefix_cache", timeout=60).json()["success"]
    assert answers(ray_app, requests(4)) == after  # still serving, on the kept weights


class StandInReplicas:
    """Replicas as the ingress's `_broadcast` reaches them: `check_weights` and `try_update_weights`."""

    def __init__(self, refuses: dict[int, str], fails: dict[int, str] | None = None) -> None:
        self.versions, self.refuses, self.fails, self.calls = [0, 0, 0], refuses, fails or {}, []

    def broadcast(self, method: str, path: str) -> list[dict]:
        self.calls.append(method)
        if method == "check_weights":
            return [{"error": self.refuses[i]} if i in self.refuses else {} for i in range(3)]
        for i in range(3):
            self.versions[i] += i not in self.fails
        return [{"error": self.fails[i]} if i in self.fails else {"weight_version": v}
                for i, v in enumerate(self.versions)]


def ingress_update(replicas: StandInReplicas, path: str) -> tuple[int, dict]:
    from coreserve.frontend.server.deploy.ray_serve import CoreserveIngress

    ingress = SimpleNamespace(_broadcast=replicas.broadcast, checkpoint="the model")
    response = asyncio.run(CoreserveIngress.func_or_class._update_all(ingress, path))
    return response.status_code, json.loads(response.body)


def test_a_refusal_on_one_replica_changes_no_replica():
    replicas = StandInReplicas({1: "model.norm.weight has shape (7,)"})
    status, body = ingress_update(replicas, "bad.safetensors")
    assert status == 400 and replicas.versions == [0, 0, 0] and replicas.calls == ["check_weights"]
    assert body["error"]["message"] == ("update_weights: replica 1 refused bad.safetensors (model.norm.weight "
                                        "has shape (7,)); every replica holds the model")
    replicas = StandInReplicas({})
    assert ingress_update(replicas, "good.safetensors") == (200, {"success": True, "weight_version": 1, "replicas": 3})
    assert replicas.versions == [1, 1, 1] and replicas.calls == ["check_weights", "try_update_weights"]
    replicas = StandInReplicas({}, fails={2: "the disk is gone"})  # after every check passed: said, not undone
    status, body = ingress_update(replicas, "good.safetensors")
    assert status == 400 and replicas.versions == [1, 1, 0]
    assert "replicas [0, 1] took good.safetensors and [2] refused it (the disk is gone)" in body["error"]["message"]
