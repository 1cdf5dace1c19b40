"""The core as a daemon: several frontends attach to one `python -m coreserve.engine_core`, each sees only its own
outputs; a frontend with another tokenizer is refused; the daemon outlives its clients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    PROMPTS,
    TEST_DTYPE,
    assert_same_greedy_tokens,
    free_blocks_are_all,
    run_daemon_command,
    running_daemon,
    start_daemon,
)

from coreserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def daemon(tiny_path, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('daemon')}/core"
    with running_daemon(tiny_path, address, "--log-level", "WARNING"):
        yield address


def test_two_frontends_share_a_daemon_and_get_only_their_own_outputs(daemon, tiny_path, llm_inproc):
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    expected = {p: llm_inproc.generate(p, params, use_tqdm=False)[0].outputs[0] for p in PROMPTS[:4]}
    clients = [LLM(tiny_path, core_address=daemon) for _ in range(2)]
    results: dict[int, list] = {}

    def run(i: int) -> None:  # the same request ids ("0", "1") from both clients at the same time
        results[i] = clients[i].generate(PROMPTS[2 * i : 2 * i + 2], params, use_tqdm=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for i, outputs in results.items():
        assert [o.prompt for o in outputs] == PROMPTS[2 * i : 2 * i + 2]
        for output in outputs:
            assert_same_greedy_tokens(output.outputs[0], expected[output.prompt])  # batched with others
    assert free_blocks_are_all(clients[0])  # engine-wide: the other client's requests are done too
    for client in clients:
        client.shutdown()
    with LLM(tiny_path, core_address=daemon) as later:  # the daemon keeps serving after clients leave
        alone = later.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == expected[PROMPTS[0]].token_ids  # alone, as llm_inproc ran it
        assert free_blocks_are_all(later)


def test_a_frontend_with_another_tokenizer_is_refused(daemon, tiny_path, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for item in Path(tiny_path).iterdir():
        if item.name != "tokenizer.json":
            os.symlink(item, other / item.name)
    tokenizer = json.loads((Path(tiny_path) / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][0], "id": 50257, "content": "<|extra|>"})
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer does not match"):
        LLM(str(other), core_address=daemon)


def test_the_daemon_refuses_a_non_loopback_address_without_the_flag(tiny_path):
    result = subprocess.run(
        [sys.executable, "-m", "coreserve.engine_core", "--model", tiny_path, "--address", "tcp://0.0.0.0:5999"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "not loopback" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--address", "ipc:///tmp/x", "--model", "M", "--max-model-len", "abc"], "--max-model-len"),
        (["--address", "tcp://127.0.0.1", "--model", "M"], "needs a host and a port"),
        (["--address", "tcp://::1:5000", "--model", "M"], "brackets"),
        (["--address", "ipc:///tmp/x"], "--model is required"),
        (["--address", "ipc:///tmp/x", "--model", "M", "--dtype", "fp8"], "--dtype"),
    ],
)
def test_command_line_mistakes_are_one_line_and_exit_code_2(args, message):
    result = run_daemon_command(*args)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_every_engine_flag_has_help():
    from coreserve.protocol.config import EngineConfig

    text = " ".join(run_daemon_command("--help").stdout.split())
    for field in EngineConfig.__struct_fields__:
        if field != "model":
            flag = "--" + field.replace("_", "-")
            assert flag in text and text.split(flag, 2)[-1].split()[1] != "--", flag


def test_engine_arguments_that_conflict_with_the_daemon_are_refused_or_applied(daemon, tiny_path):
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(tiny_path, core_address=daemon, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_logprobs=50 is more than the daemon's"):
        LLM(tiny_path, core_address=daemon, max_logprobs=50)
    with LLM(tiny_path, core_address=daemon, max_model_len=64, max_logprobs=2) as llm:
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.generate([5] * 100, SamplingParams(max_tokens=4), use_tqdm=False)
        with pytest.raises(ValueError, match="max_logprobs=2"):
            llm.generate(PROMPTS[0], SamplingParams(logprobs=3), use_tqdm=False)
        out = llm.generate([5] * 60, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_a_client_that_exits_without_shutdown_says_goodbye(daemon, tiny_path):
    script = (
        "import sys, threading, time\n"
        "from frontend import LLM, SamplingParams\n"
        f"llm = LLM({tiny_path!r}, core_address={daemon!r})\n"
        "params = SamplingParams(max_tokens=1500, ignore_eos=True)\n"
        "threading.Thread(target=llm.generate, args=(['a b c'] * 4, params), daemon=True).start()\n"
        "time.sleep(2.0)\n"
        "sys.exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120, capture_output=True)
    with LLM(tiny_path, core_address=daemon) as observer:
        deadline = time.monotonic() + 5  # the daemon's silence timeout is 30 s
        while observer.get_engine_stats().num_running and time.monotonic() < deadline:
            time.sleep(0.2)
        assert free_blocks_are_all(observer)


def test_sigterm_removes_the_socket_files_and_ipv6_loopback_serves(tiny_path, tmp_path):
    import socket

    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    address = f"tcp://[::1]:{port}"
    proc = start_daemon(tiny_path, address, "--num-kv-blocks", "64", "--log-level", "WARNING")
    with LLM(tiny_path, core_address=address) as llm:
        assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    address = f"ipc://{tmp_path}/sub/core"
    proc = start_daemon(tiny_path, address, "--num-kv-blocks", "64", "--log-level", "WARNING")
    assert os.path.exists(f"{tmp_path}/sub/core.in")
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert not os.listdir(tmp_path / "sub")


def test_attaching_to_a_silent_address_fails_within_the_attach_timeout_naming_it(tiny_path, tmp_path, monkeypatch):
    """The wait is ATTACH_TIMEOUT_S (15 s); shortened here so the suite does not sit through it."""
    from coreserve import EngineDeadError
    from coreserve.frontend.clients import core_client

    assert core_client.ATTACH_TIMEOUT_S == 15.0
    monkeypatch.setattr(core_client, "ATTACH_TIMEOUT_S", 2.0)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"ipc://{tmp_path}/nothing"):
        LLM(tiny_path, core_address=f"ipc://{tmp_path}/nothing")
    assert 2.0 <= time.monotonic() - started < 5


def start_faulty_core(model: str, address: str, fault: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "tools" / "faulty_core.py"), model, address, fault],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stderr=subprocess.PIPE,
        text=True,
    )
    while not os.path.exists(address[len("ipc://") :] + ".in"):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    return proc


def test_a_fatal_core_error_reaches_the_client_with_its_message(tiny_path, tmp_path):
    from coreserve import EngineDeadError

    address = f"ipc://{tmp_path}/core"
    proc = start_faulty_core(tiny_path, address, "step")
    with LLM(tiny_path, core_address=address) as llm:
        with pytest.raises(EngineDeadError, match="injected device failure"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)
    assert proc.wait(timeout=30) != 0


def test_a_thread_that_dies_stops_the_core_with_the_reason(tiny_path, tmp_path):
    address = f"ipc://{tmp_path}/core"
    proc = start_faulty_core(tiny_path, address, "output-thread")
    assert proc.wait(timeout=30) != 0
    assert "thread core-output died" in proc.stderr.read()
    assert not os.path.exists(f"{tmp_path}/core.in")


def test_the_daemon_takes_a_builtin_model_name(tiny_path, tmp_path):
    address = f"ipc://{tmp_path}/core"
    flags = ("--num-kv-blocks", "64", "--log-level", "WARNING", "--dtype", TEST_DTYPE)  # bf16 mode too
    proc = start_daemon("builtin:tiny", address, *flags)
    with LLM("builtin:tiny", core_address=address) as llm:
        assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    proc.terminate()
    assert proc.wait(timeout=30) == 0
