"""coreserve against llama.cpp's server on the same GGUF file, side by side in one run (issue 25).

    scripts/build_llama_server.sh                    # once: llama-server from the llama-cpp-python sdist
    python scripts/bench_llama_cpp.py                # builtin:smollm2's Q4_1 file, concurrency 1 and 32
    python scripts/bench_llama_cpp.py --rounds 3 --max-tokens 128 --json bench_out/llama_cpp.json

Both servers get the same prompts as text over /v1/completions: greedy, `ignore_eos`, `max_tokens`
out each; output tokens/s is the completion tokens of a batch of `concurrency` requests over its wall
time. The rounds alternate the two servers (A B B A ...), and each is up only while it is measured, so
neither runs beside the other. Each round warms its server with one short request, then measures
`--repeats` batches (a server's first request after its start ran up to 10% slower, and one 1-second
request is a noisy sample); the figure is each server's median over all its batches. coreserve serves
the file as it is (quantized in memory, the default `dtype`); llama-server runs with as many threads
as cores and one slot per concurrent request.

Logprob distance: for each prompt, llama-server's greedy tokens and their logprobs (`n_probs`, taken
before sampling) are scored by coreserve with the same file dequantized to fp32 at load (the
tokens' own prompt logprobs, teacher-forced on llama.cpp's token ids); the script reports the largest and
the mean |llama.cpp - fp32| next to coreserve's quantized-in-memory run, whose distance to the fp32
model tests/test_gguf_quantized.py proves to be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = Path.home() / ".cache" / "coreserve" / "llama.cpp-0.3.36" / "build" / "bin" / "llama-server"
PROMPTS = [
    "The capital of France is", "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works in simple terms.", "List five fruits that are red.",
    "What is the difference between weather and climate?", "Describe a sunset over the ocean.",
    "Give three tips for learning a new language.", "Why is the sky blue?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2", help="a GGUF file, or builtin:smollm2")
    parser.add_argument(
        "--llama-server", default=str(LLAMA_SERVER), help="default: scripts/build_llama_server.sh's"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per concurrency")
    parser.add_argument("--repeats", type=int, default=3, help="measured batches per round, after a warm-up")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gguf = gguf_path(args.model)
    binary = args.llama_server
    if not Path(binary).exists():
        raise SystemExit(f"{binary} is missing: build it with scripts/build_llama_server.sh")
    results: dict = {"machine": machine(), "model": gguf, "max_tokens": args.max_tokens, "runs": {}}
    for concurrency in args.concurrency:
        rows = {"coreserve": [], "llama.cpp": []}
        for round_ in range(args.rounds):
            order = ["coreserve", "llama.cpp"] if round_ % 2 == 0 else ["llama.cpp", "coreserve"]
            for name in order:
                with start(name, gguf, binary, concurrency) as server:
                    asyncio.run(throughput(server.base, 1, 8))  # warm-up, not counted
                    for _ in range(args.repeats):
                        rows[name].append(asyncio.run(throughput(server.base, concurrency, args.max_tokens)))
        summary = {name: median(values) for name, values in rows.items()}
        summary["coreserve / llama.cpp"] = summary["coreserve"] / summary["llama.cpp"]
        results["runs"][f"concurrency {concurrency}"] = {"tokens/s (median)": summary, "batches": rows}
        print(
            f"concurrency {concurrency}: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()), flush=True
        )
    results["logprob distance"] = distance(gguf, binary, args.max_tokens)
    print(json.dumps(results["logprob distance"], indent=2))
    if args.json:
        write_json(args.json, results)


def gguf_path(model: str) -> str:
    if model == "builtin:smollm2":
        from coreserve.protocol.builtin_model import smollm2_path

        return smollm2_path()
    return model


class start:
    """A server on a free loopback port for the `with` block: coreserve's or llama.cpp's (`base` its URL).
    `extra`: more command-line arguments."""

    def __init__(self, name: str, gguf: str, binary: str, concurrency: int, dtype: str | None = None,
                 extra: list[str] | None = None) -> None:
        self.name, self.gguf, self.binary, self.concurrency = name, gguf, binary, concurrency
        self.dtype, self.extra = dtype, list(extra or [])

    def engine_pid(self) -> int:
        """The process that holds the model: llama-server itself, coreserve's engine-core child (found by
        its command line: the frontend's chat-template renderers are its children too)."""
        if self.name != "coreserve":
            return self.proc.pid
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        cores = [pid for pid in children
                 if b"coreserve.engine_core" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        if len(cores) != 1:
            raise RuntimeError(f"coreserve's server has children {children}, of which {cores} are engine cores")
        return int(cores[0])

    def __enter__(self) -> start:
        port = _free_port()
        if self.name == "coreserve":
            command = [sys.executable, "-m", "coreserve", "serve", self.gguf, "--port", str(port), "--log-level",
                       "warning", "--max-num-seqs", str(max(32, self.concurrency)), "--served-model-name", "m"]
            command += (["--dtype", self.dtype] if self.dtype else []) + self.extra
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        else:
            threads = str(os.cpu_count() or 1)
            command = [self.binary, "-m", self.gguf, "--port", str(port), "--host", "127.0.0.1", "-t", threads,
                       "-np", str(self.concurrency), "-c", str(1024 * self.concurrency), "--no-webui", *self.extra]
            env = dict(os.environ)
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _healthy(self.base):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start: {command}")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def throughput(base: str, concurrency: int, max_tokens: int) -> float:
    """Output tokens/s of `concurrency` requests sent at once (the prompts in turn)."""
    async with httpx.AsyncClient(timeout=None) as http:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
        started = time.perf_counter()
        outs = await asyncio.gather(*(_complete(http, base, p, max_tokens) for p in prompts))
        elapsed = time.perf_counter() - started
    return sum(out["usage"]["completion_tokens"] for out in outs) / elapsed


async def _complete(http: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = await http.post(base + "/v1/completions", json={**body, **extra})
    response.raise_for_status()
    return response.json()


def distance(gguf: str, binary: str, max_tokens: int, dtype: str = "float32") -> dict:
    """llama.cpp's greedy tokens' logprobs against the fp32-dequantized model's for the same tokens; `dtype`
    "auto" scores them with the file's blocks kept, the same bits (docs/quantized.md) without a float copy."""
    with start("llama.cpp", gguf, binary, 1) as server:
        theirs = [_llama_tokens(server.base, prompt, min(max_tokens, 32)) for prompt in PROMPTS]
    from coreserve.frontend.llm import LLM
    from coreserve.protocol.sampling_params import SamplingParams

    llm = LLM(gguf, dtype=dtype)
    try:
        gaps = []
        for prompt_ids, ids, logprobs in theirs:
            out = llm.generate([{"prompt_token_ids": prompt_ids + ids}],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            rows = out.prompt_logprobs[len(prompt_ids) :]
            gaps += [abs(row[t].logprob - lp) for row, t, lp in zip(rows, ids, logprobs)]
    finally:
        llm.shutdown()
    return {"tokens": len(gaps), "max |llama.cpp - fp32|": max(gaps), "mean": sum(gaps) / len(gaps),
            "coreserve quantized-in-memory": 0.0}


def _llama_tokens(base: str, prompt: str, n: int) -> tuple[list[int], list[int], list[float]]:
    """llama-server's prompt ids (its own tokenizer), greedy ids and their logprobs before sampling."""
    prompt_ids = httpx.post(base + "/tokenize", json={"content": prompt, "add_special": False}).json()[
        "tokens"
    ]
    body = {
        "prompt": prompt_ids,
        "n_predict": n,
        "temperature": 0.0,
        "n_probs": 1,
        "post_sampling_probs": False,
    }
    out = httpx.post(base + "/completion", json=body, timeout=None).json()
    probs = out["completion_probabilities"]
    return prompt_ids, [p["id"] for p in probs], [p["logprob"] for p in probs]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
