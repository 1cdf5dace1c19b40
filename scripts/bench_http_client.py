"""The HTTP side of bench_serving.py: streamed POST /v1/completions against any OpenAI-compatible
server (coreserve serve, vLLM, llama.cpp's llama-server), timed chunk by chunk.

Server-sent events are read line by line as vLLM's own benchmark does (a `data: ` line per event), with
httpx streaming and msgspec decoding: the client shares this machine's cores with the server, so it
stays as light as it can.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import msgspec


class HttpDriver:
    """`await driver.run(prompt, max_tokens)` -> (start, chunk arrival times, completion tokens)."""

    def __init__(self, args, tokenizer) -> None:
        self.url = args.base_url.rstrip("/") + "/v1/completions"
        self.model = args.served_model_name or args.model
        self.args = args
        self.tokenizer = tokenizer
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(headers=headers, timeout=None, limits=limits)

    def payload(self, prompt: list[int], max_tokens: int) -> dict:
        body = {
            "model": self.model,
            "prompt": self.tokenizer.decode(prompt) if self.args.send_text else prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # vLLM's and llama-server's name; exact output lengths
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.logprobs is not None:
            body["logprobs"] = self.args.logprobs
        if self.args.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.args.prompt_logprobs
        return body

    async def run(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
        start, times, num_tokens, usage = time.perf_counter(), [], 0, None
        async with self.http.stream("POST", self.url, json=self.payload(prompt, max_tokens)) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{self.url}: {response.status_code} {(await response.aread())[:500]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = msgspec.json.decode(line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    if choice.get("text") or (choice.get("logprobs") or {}).get("tokens"):
                        times.append(time.perf_counter())
                        num_tokens += len((choice.get("logprobs") or {}).get("tokens") or [None])
        if usage is not None:
            num_tokens = usage["completion_tokens"]
        return start, times, num_tokens

    async def close(self) -> None:
        await self.http.aclose()


class LocalServer:
    """`coreserve serve` started by the benchmark (--serve) with the run's engine arguments, on a free
    loopback port; `shutdown()` stops it and its core."""

    def __init__(self, args, startup_timeout_s: float = 600.0) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [sys.executable, "-m", "coreserve", "serve", args.model, "--port", str(port)]
        command += ["--log-level", "warning", "--num-scheduler-steps", str(args.num_scheduler_steps)]
        command += ["--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype]
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        command += ["--enable-prefix-caching", str(args.enable_prefix_caching).lower()]
        self.proc = subprocess.Popen(command)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_timeout_s
        while not self._is_healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"coreserve serve did not start: {' '.join(command)}")
            time.sleep(0.3)

    def _is_healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def shutdown(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
