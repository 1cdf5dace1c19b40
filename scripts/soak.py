"""A soak run against an OpenAI-compatible coreserve server (issue 39): a bounded mix of requests for a
given time, every answer checked against the same request sent alone, with throughput, latency, errors
by kind and the processes' memory and open files over time.

    python scripts/soak.py --duration 1800                       # starts `coreserve serve builtin:smollm2`
    python scripts/soak.py --base http://127.0.0.1:8000 --pid 1234 --duration 600
    python scripts/soak.py --model builtin:tiny --duration 60 --json bench_out/soak.json --plot docs/soak.png

The mix, `--concurrency` clients each taking the next kind in turn: completions (greedy, logprobs=2,
prompt_logprobs=1), seeded sampling (temperature 1, seed, logprobs), chat (greedy, logprobs), a
streamed completion (its chunks put together), a JSON-schema and a regex structured output, an aborted
stream (the client leaves after its first chunk), an oversize body (a 413 expected) and a malformed one
(a 400 expected); with `--control-every`, an RL loop's control cycle beside them (pause, sleep, wake,
resume, and the model's own weights loaded again from `--weights`). Before the run each checked kind is
sent alone once: its reference. Every answer
during the run must equal its reference bit for bit (token ids, logprob values, text): engines that are
batch invariant give the same numbers whatever shares the batch. A request that fails, hangs past
`--timeout`, or answers another status than expected counts as an error of its kind.

Every `--sample-s` seconds: the resident memory (VmRSS) and open file descriptors of the server process
and its engine core (found as its child). The report compares, after the
warm-up (`--warmup-s`): the floor (lowest sample) of the last third against that of the first (the KV
cache's pages come and go; a leak raises the floor). `--plot` writes RSS and open files over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def kinds(model: str) -> dict[str, dict]:
    """kind -> (endpoint, body, expected status, whether its answer is checked)."""
    completion = {"model": model, "prompt": "The history of the printing press", "max_tokens": 24,
                  "temperature": 0.0, "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": True}
    return {
        "completion": {"path": "/v1/completions", "body": completion},
        "seeded": {"path": "/v1/completions", "body": {**completion, "prompt": "A list of colours:",
                                                       "temperature": 1.0, "seed": 7, "prompt_logprobs": None}},
        "chat": {"path": "/v1/chat/completions",
                 "body": {"model": model, "messages": [{"role": "user", "content": "Name three rivers."}],
                          "max_tokens": 20, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}},
        "stream": {"path": "/v1/completions", "stream": True,
                   "body": {**completion, "prompt": "Once upon a time", "prompt_logprobs": None, "stream": True}},
        "json": {"path": "/v1/completions",
                 "body": {"model": model, "prompt": "A person as JSON:", "max_tokens": 40, "temperature": 0.0,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}},
        "regex": {"path": "/v1/completions",
                  "body": {"model": model, "prompt": "Today's date:", "max_tokens": 12, "temperature": 0.0,
                           "structured_outputs": {"regex": r"20\d\d-(0[1-9]|1[0-2])-[0-2]\d"}}},
        "aborted": {"path": "/v1/completions", "abort": True,
                    "body": {**completion, "max_tokens": 200, "prompt_logprobs": None, "stream": True}},
        "oversize": {"path": "/v1/completions", "status": 413, "raw": b"{" + b" " * (9 * 1024 * 1024) + b"}"},
        "malformed": {"path": "/v1/completions", "status": 400, "raw": b'{"model": "m", "prompt": '},
    }


def answer_of(kind: dict, reply: httpx.Response | list[dict]) -> object:
    """What must equal the reference: the choices' token ids, logprobs and texts (not ids or times)."""
    if kind.get("stream"):
        text, logprobs = "", []
        for chunk in reply:
            for choice in chunk["choices"]:
                text += choice.get("text") or ""
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
        return text, logprobs
    body = reply.json()
    return [(c.get("text"), c.get("message"), c.get("logprobs"), c.get("prompt_logprobs"))
            for c in body["choices"]]


async def send(http: httpx.AsyncClient, kind: dict, timeout: float) -> tuple[int, object]:
    """(status, answer) of one request of `kind`."""
    if "raw" in kind:
        reply = await http.post(kind["path"], content=kind["raw"], headers={"content-type": "application/json"},
                                timeout=timeout)
        return reply.status_code, None
    if kind.get("stream") or kind.get("abort"):
        chunks = []
        async with http.stream("POST", kind["path"], json=kind["body"], timeout=timeout) as reply:
            if reply.status_code != 200:
                return reply.status_code, None
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[6:]))
                if kind.get("abort"):
                    return 200, None  # the client leaves: the server must abort the request
        return 200, answer_of(kind, chunks)
    reply = await http.post(kind["path"], json=kind["body"], timeout=timeout)
    return reply.status_code, answer_of(kind, reply) if reply.status_code == 200 else None


class Soak:
    def __init__(self, base: str, model: str, pids: list[int], args: argparse.Namespace) -> None:
        self.base, self.args, self.pids = base, args, pids
        self.kinds = kinds(model)
        self.references: dict[str, object] = {}
        self.latencies: dict[str, list[float]] = {name: [] for name in self.kinds}
        self.errors: dict[str, int] = {}
        self.wrong: dict[str, int] = {}
        self.samples: list[dict] = []
        self.controls: dict[str, int] = {}  # RL control calls that succeeded, by endpoint
        self.completion_tokens = 0

    async def run(self) -> dict:
        async with httpx.AsyncClient(base_url=self.base, timeout=self.args.timeout) as http:
            for name, kind in self.kinds.items():  # the references: each kind alone
                status, answer = await send(http, kind, self.args.timeout)
                if status != kind.get("status", 200):
                    raise SystemExit(f"{name} alone answered {status}: the server is not ready for a soak")
                self.references[name] = answer
            started = time.monotonic()
            self.deadline = started + self.args.duration
            sampler = asyncio.create_task(self.sample(started))
            control = asyncio.create_task(self.control(http)) if self.args.control_every else None
            await asyncio.gather(*(self.client(http, i) for i in range(self.args.concurrency)))
            sampler.cancel()
            if control is not None:
                control.cancel()
            self.samples.append(self.sample_once(started))
            elapsed = time.monotonic() - started
        return self.report(elapsed)

    async def client(self, http: httpx.AsyncClient, index: int) -> None:
        names = list(self.kinds)
        turn = index
        while time.monotonic() < self.deadline:
            name = names[turn % len(names)]
            turn += 1
            kind = self.kinds[name]
            begun = time.perf_counter()
            try:
                status, answer = await send(http, kind, self.args.timeout)
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                self._count(self.errors, f"{name}: {type(exc).__name__}")
                continue
            self.latencies[name].append(time.perf_counter() - begun)
            if status != kind.get("status", 200):
                self._count(self.errors, f"{name}: HTTP {status}")
            elif answer != self.references[name]:
                self._count(self.wrong, name)

    async def control(self, http: httpx.AsyncClient) -> None:
        """Every --control-every seconds an RL loop's cycle through the RL endpoints while the clients go
        on: pause (running requests finish, new ones wait), sleep and wake (the KV cache freed and back),
        resume, then the same weights loaded from disk (--weights): no answer may change."""
        steps = [("/pause", {"mode": "wait"}, None), ("/sleep", {"level": 1}, None), ("/wake_up", {}, None),
                 ("/resume", {}, None), ("/update_weights_from_disk", {}, {"model_path": self.args.weights})]
        while True:
            await asyncio.sleep(self.args.control_every)
            for path, query, body in steps:
                if body is not None and not self.args.weights:
                    continue
                try:
                    reply = await http.post(path, params=query, json=body, timeout=self.args.timeout)
                    ok = reply.status_code == 200
                except httpx.HTTPError:
                    ok = False
                self._count(self.controls, path) if ok else self._count(self.errors, f"control {path}")

    async def sample(self, started: float) -> None:
        while True:
            self.samples.append(self.sample_once(started))
            await asyncio.sleep(self.args.sample_s)

    def sample_once(self, started: float) -> dict:
        sample = {"t": time.monotonic() - started}
        for role, pid in zip(("server", "core"), self.pids):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                sample[f"{role} RSS MiB"] = int(status.split("VmRSS:")[1].split()[0]) / 1024
                sample[f"{role} open files"] = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, IndexError, ValueError):
                pass
        return sample

    def report(self, elapsed: float) -> dict:
        done = [s for s in self.samples if s["t"] >= self.args.warmup_s] or self.samples[-1:]
        third = max(1, len(done) // 3)
        early, late = done[:third], done[-third:]
        # the lowest of each third: the KV cache's pages come and go (committed as blocks are written,
        # freed by a sleep), what a leak leaves is a floor that rises
        growth = {key: min(s[key] for s in late if key in s) / min(s[key] for s in early if key in s)
                  for key in done[0] if key != "t" and done[0].get(key)}
        all_latencies = [v for values in self.latencies.values() for v in values]
        return {
            "duration s": elapsed,
            "requests": {name: len(v) for name, v in self.latencies.items()},
            "requests/s": len(all_latencies) / elapsed,
            "p50 latency s": statistics.median(all_latencies) if all_latencies else None,
            "p99 latency s": sorted(all_latencies)[int(0.99 * (len(all_latencies) - 1))] if all_latencies else None,
            "control calls": self.controls,
            "errors": self.errors,
            "wrong answers": self.wrong,
            "late / early floor after warm-up": growth,
            "samples": self.samples,
        }

    @staticmethod
    def _count(table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    figure, (rss, files) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for role in ("server", "core"):
        t = [s["t"] / 60 for s in samples if f"{role} RSS MiB" in s]
        rss.plot(t, [s[f"{role} RSS MiB"] for s in samples if f"{role} RSS MiB" in s], label=role)
        files.plot(t, [s[f"{role} open files"] for s in samples if f"{role} open files" in s], label=role)
    rss.set_ylabel("RSS (MiB)")
    files.set_ylabel("open files")
    files.set_xlabel("minutes")
    rss.legend()
    rss.set_title(f"soak: {sum(result['requests'].values())} requests, "
                  f"{sum(result['wrong answers'].values())} wrong, {sum(result['errors'].values())} errors")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def start_server(model: str, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "coreserve", "serve", model, "--port", str(port),
                             "--log-level", "warning", "--served-model-name", "m", *flags], cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(0.2)


def core_pid(pid: int) -> int | None:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None, help="a running server; default: start one of --model")
    parser.add_argument("--pid", type=int, default=None, help="the running server's pid (its core: its child)")
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--served-model-name", default="m")
    parser.add_argument("--chat-template", default=None, help="for a server started here whose model has none")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--control-every", type=float, default=0.0,
                        help="seconds between RL control cycles (pause, sleep, wake, resume, update); 0: none. "
                        "The server needs --enable-rl-endpoints (a server started here gets it)")
    parser.add_argument("--weights", default=None,
                        help="the model's own checkpoint (safetensors) for the cycle's update_weights_from_disk")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    proc = None
    if args.base is None:
        flags = ["--chat-template", args.chat_template] if args.chat_template else []
        proc, args.base = start_server(args.model, flags + (["--enable-rl-endpoints"] if args.control_every else []))
        args.pid = proc.pid
    try:
        pids = [p for p in (args.pid, core_pid(args.pid) if args.pid else None) if p]
        result = asyncio.run(Soak(args.base, args.served_model_name, pids, args).run())
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
