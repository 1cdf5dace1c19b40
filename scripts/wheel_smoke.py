"""The checks of scripts/wheel_smoke.sh, run by the fresh venv's python (coreserve installed from the built
wheel or sdist, no compiler on PATH, the working folder outside the repository): starts
`coreserve serve builtin:smollm2` with LoRA and tool calls on, then through the official `openai` client
asks the demo's chat question, a `tool_choice: "required"` chat, a runtime-loaded LoRA adapter and a
batch-invariance comparison; stops the server, which must exit 0. Prints each step; exits non-zero on
the first failure.

    python scripts/wheel_smoke.py --label wheel --work /tmp/smoke
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
from safetensors.numpy import save_file

MODEL = "builtin:smollm2"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]  # scripts/demo.py's turn
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}}]
# SmolLM2-135M's shapes (the GGUF's llama.* keys): 30 layers, hidden 576, 3 KV heads of 64
NUM_LAYERS, HIDDEN, KV_WIDTH = 30, 576, 3 * 64
FALLBACK_WARNINGS = ("no C compiler found", "CPU kernels unavailable")  # coreserve/worker/cpu/kernels.py
STARTUP_TIMEOUT_S = 300


def serve_command(port: int) -> list[str]:
    """SmolLM2's template writes hermes' <tool_call> blocks (tests/test_server_tools.py). fp32 weights:
    its Q4_1 blocks multiply in one order at any batch size whatever the setting, so only dequantized
    products can show a batch-invariance break (with --batch-invariant false they do: 3 of 3 differ)."""
    return [shutil.which("coreserve") or "coreserve", "serve", MODEL, "--port", str(port), "--dtype", "float32",
            "--enable-lora", "--max-lora-rank", "8", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--max-model-len", "2048", "--shutdown-timeout", "5"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(log_path: Path):
    """The server until the block ends; then SIGTERM, and it must exit 0."""
    port = free_port()
    command = serve_command(port)
    print("$", " ".join(command), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log_path)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise AssertionError(f"the server exited with {proc.returncode} on SIGTERM:\n{tail(log_path)}")


def wait_healthy(base: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError):  # refused until it listens; urllib's errors are OSErrors
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the server did not start (exit {proc.poll()}):\n{tail(log_path)}")
        time.sleep(0.5)


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def check_chat(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    text = answer.choices[0].message.content or ""
    assert text.strip(), f"an empty chat answer: {answer}"
    assert "paris" in text.lower(), f"the demo's question answered without Paris: {text!r}"
    print(f"ok chat: {text!r}", flush=True)


def check_required_tool_call(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                            max_tokens=48, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, f"no tool call: {answer}"
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(arguments.get("city"), str), call
    print(f"ok tool call (required): {call.function.name}({call.function.arguments})", flush=True)


def write_adapter(folder: Path, rank: int = 8, seed: int = 0) -> None:
    """A PEFT LoRA folder on q_proj and v_proj of every layer, random A and B large enough to move the
    logprobs (docs/lora.md: A [r, in], B [out, r], PEFT's tensor names)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for target, width in (("q_proj", HIDDEN), ("v_proj", KV_WIDTH)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, HIDDEN)) * HIDDEN**-0.5).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((width, rank)) * 0.05).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
              "bias": "none", "use_rslora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def post_json(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def check_runtime_lora(client: openai.OpenAI, base: str, folder: Path) -> None:
    write_adapter(folder)
    status, text = post_json(base + "/v1/load_lora_adapter", {"lora_name": "smoke", "lora_path": str(folder)})
    assert status == 200, f"load_lora_adapter: {status} {text}"
    assert "smoke" in {model.id for model in client.models.list().data}, "the adapter is not in /v1/models"

    def logprobs(model: str) -> tuple[str, list[float]]:
        done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, logprobs=1)
        assert done.model == model, f"answered as {done.model!r}, not {model!r}"
        return done.choices[0].text, done.choices[0].logprobs.token_logprobs

    base_text, base_logprobs = logprobs(MODEL)
    lora_text, lora_logprobs = logprobs("smoke")
    assert lora_logprobs != base_logprobs, "the adapter changed no logprob"
    print(f"ok runtime LoRA: base {base_text!r}, adapter {lora_text!r}", flush=True)


def batch_invariance_mismatches(client: openai.OpenAI) -> int:
    """Random token-id prompts in one batch of 8, then three of them alone: how many alone answers differ
    (tokens, sampled logprobs or the top-5 lists) from their place in the batch (tests/test_batch_invariance.py)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randint(1, 24))] for _ in range(8)]

    def rows(prompt):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.6, seed=77,
                                         logprobs=5)
        return [(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs)
                for c in sorted(done.choices, key=lambda c: c.index)]

    batched = rows(prompts)
    return sum(rows(prompts[i])[0] != batched[i] for i in (0, 3, 7))


def check_batch_invariance(client: openai.OpenAI, log_path: Path) -> None:
    """Claimed on the C kernels (README, "Same request, same bits"): the package must carry them (the wheel
    its prebuilt variants, an sdist what its build compiled), so the server must not fall back to the torch
    paths."""
    prebuilt = installed_kernel_libraries()
    fell_back = any(warning in log_path.read_text(errors="replace") for warning in FALLBACK_WARNINGS)
    assert prebuilt and not fell_back, f"prebuilt kernels {prebuilt}, fell back: {fell_back}\n{tail(log_path)}"
    mismatches = batch_invariance_mismatches(client)
    assert mismatches == 0, f"{mismatches} of 3 prompts differ alone and in a batch of 8"
    where = f"{len(prebuilt)} prebuilt libraries in the package" if prebuilt else "built at first use"
    choice = [line for line in log_path.read_text(errors="replace").splitlines() if "CPU kernels:" in line]
    where += f"; the core: {choice[0].split('CPU kernels:', 1)[1].strip()}" if choice else ""
    print(f"ok batch invariance on the C kernels ({where}): 3 prompts alone equal their rows in a batch of 8",
          flush=True)


def installed_kernel_libraries() -> list[str]:
    """Prebuilt kernel libraries shipped inside the installed package (none before a kernel build hook)."""
    spec = importlib.util.find_spec("coreserve")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return sorted(str(path.relative_to(root)) for root in roots for path in root.rglob("*.so"))


def run_checks(label: str, work: Path) -> int:
    """The checks in order, the server's clean exit last; returns how many passed before any failure."""
    log_path = work / f"server-{label}.log"
    passed = 0
    try:
        with running_server(log_path) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
            for check in (lambda: check_chat(client), lambda: check_required_tool_call(client),
                          lambda: check_runtime_lora(client, base, work / f"adapter-{label}"),
                          lambda: check_batch_invariance(client, log_path)):
                check()
                passed += 1
    except AssertionError as failure:
        print(f"FAILED ({label}): {failure}", file=sys.stderr)
        print(f"{label}: {passed} passed, 1 failed", flush=True)
        sys.exit(1)
    print(f"ok server exited 0 ({label})", flush=True)
    return passed + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="what was installed (wheel, sdist): names the log")
    parser.add_argument("--work", type=Path, required=True, help="a scratch folder for the log and adapter")
    args = parser.parse_args()
    print(f"{args.label}: {run_checks(args.label, args.work)} passed, 0 failed", flush=True)


if __name__ == "__main__":
    main()
