"""Helpers for the server tests (tests/test_server_*.py): a real `python -m coreserve serve` process on a
free loopback port, and readers of its responses. Each test module starts one server."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from coreserve.protocol.builtin_model import builtin_model_path

API_KEY = "sk-test-coreserve"
MODEL = "builtin:tiny"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REPO = Path(__file__).resolve().parent.parent
SHUTDOWN_TIMEOUT_S = 5  # a test's server drains this long at most when it ends (the command's default: 30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(
    *flags: str, startup_timeout_s: float = 180.0, model: str | None = None, omit_model: bool = False,
    new_session: bool = False,
):
    """`python -m coreserve serve MODEL --port P FLAGS` until /health answers; yields (url, process).
    MODEL: builtin:tiny (its bf16 copy in bf16 mode), or `model` as given (e.g. the SmolLM2 GGUF);
    `omit_model`: none at all (the command's default, builtin:smollm2). `new_session`: the server leads
    a process group of its own, which a test may signal whole (os.killpg(proc.pid, ...)). At the end a
    SIGTERM drains for at most SHUTDOWN_TIMEOUT_S (unless FLAGS say otherwise), and the server must exit
    0 and leave no core behind."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "coreserve",
        "serve",
        *([] if omit_model else [model] if model else served_model()),
        "--port",
        str(port),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("CORESERVE_API_KEY", None)
    command += ["--log-level", "warning", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    proc = subprocess.Popen([*command, *flags], cwd=REPO, env=env, start_new_session=new_session)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not is_healthy(base):
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield base, proc
    finally:
        cores = core_pids(proc.pid)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"the server exited with {proc.returncode} on SIGTERM"  # it drained
    assert all(is_gone(pid) for pid in cores), "the server left its engine core running"


def served_model() -> list[str]:
    """MODEL, or in bf16 mode its bf16 copy (tiny_path's) under MODEL's name; a later
    --served-model-name among the flags still wins."""
    from conftest import IS_BF16_MODE, in_test_dtype

    if not IS_BF16_MODE:
        return [MODEL]
    return [in_test_dtype(builtin_model_path(MODEL.split(":", 1)[1])), "--served-model-name", MODEL]


def core_pids(server_pid: int) -> list[int]:
    """The `python -m coreserve.engine_core` processes the server spawned (none when attached to a daemon)."""
    try:
        children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    except OSError:
        return []
    return [int(c) for c in children if b"coreserve.engine_core" in _cmdline(int(c))]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def is_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "State:\tZ" in status.read_text():
            return True
        time.sleep(0.1)
    return False


def latencies_while(base: str, request: Callable[[], object], probe: str = "/health") -> tuple[object, float, list[float]]:
    """Runs `request` on a thread and, until it returns, times a GET of `probe` every 20 ms: (what it
    returned, its seconds, the probes' latencies). The event loop is free while the probes stay fast."""
    done = {}

    def run() -> None:
        started = time.perf_counter()
        done["result"] = request()
        done["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=run)
    thread.start()
    latencies = []
    with httpx.Client(base_url=base, timeout=60) as http:
        while thread.is_alive():
            started = time.perf_counter()
            assert http.get(probe).status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    thread.join()
    return done["result"], done["seconds"], latencies


def is_healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def chat_template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    path.write_text(CHATML)
    return str(path)


def text_of(decoded_token: str) -> str:
    """A token's text as the server writes it: itself, or bytes:\\xNN... for a piece of a character."""
    try:
        decoded_token.encode("utf-8")
    except UnicodeEncodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in decoded_token.encode("utf-8", "surrogateescape"))
    return decoded_token


def metric_values(http: httpx.Client) -> dict[str, float]:
    """/metrics samples without labels, by name."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_until_idle(http: httpx.Client, timeout_s: float = 2.0) -> bool:
    """Every KV block free and nothing running, as /metrics says, within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        values = metric_values(http)
        is_free = values["coreserve:kv_blocks_free"] == values["coreserve:kv_blocks_total"]
        if is_free and not values["coreserve:num_requests_running"]:
            return True
        time.sleep(0.1)
    return False


@contextlib.contextmanager
def running_router_process(command: list[str], base: str, name: str, startup_timeout_s: float = 60.0):
    """A router or gateway (`command`, listening at `base`) until its /v1/models answers; stopped after."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            assert proc.poll() is None, f"{name} exited with {proc.returncode}: {proc.stderr.read()[:1500]}"
            assert time.monotonic() < deadline, f"{name} did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
