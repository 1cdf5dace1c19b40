"""CURVE on the daemon's TCP sockets: an authorised client generates; a client with an unknown key and
a plain one are refused at the connection (logged by the daemon, none of their bytes decoded); key
files must be private."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import zmq
from conftest import PROMPTS, ROOT, run_daemon_command

from coreserve import LLM, SamplingParams
from coreserve.protocol.curve_keys import load_key_pair, make_key_pair


def free_port_pair() -> int:
    with socket.socket() as a:
        a.bind(("127.0.0.1", 0))
        port = a.getsockname()[1]
    return port if port < 65000 else 40000


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    result = run_daemon_command("keygen", str(root / "server"))
    assert result.returncode == 0, result.stderr
    make_key_pair(str(root / "clients"), "alice")
    make_key_pair(str(root / "strangers"), "mallory")
    allowed = root / "authorized"
    allowed.mkdir()
    (allowed / "alice.key").write_bytes((root / "clients" / "alice.key").read_bytes())
    return root


@pytest.fixture(scope="module")
def daemon(tiny_path, keys):
    address = f"tcp://127.0.0.1:{free_port_pair()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coreserve.engine_core",
            "--model",
            tiny_path,
            "--address",
            address,
            "--num-kv-blocks",
            "64",
            "--curve-secret-key",
            str(keys / "server" / "server.key_secret"),
            "--authorized-clients",
            str(keys / "authorized"),
            "--log-level",
            "WARNING",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stderr=subprocess.PIPE,
        text=True,
    )
    yield address, proc
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def curve_args(keys, client: str = "clients/alice") -> dict:
    return dict(
        curve_server_key=str(keys / "server" / "server.key"),
        curve_client_keys=str(keys / f"{client}.key_secret"),
    )


def test_an_authorised_client_generates(daemon, tiny_path, keys):
    with LLM(tiny_path, core_address=daemon[0], **curve_args(keys)) as llm:
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 5


def test_unknown_and_plain_clients_are_refused_and_logged(daemon, tiny_path, keys):
    address, proc = daemon
    host, port = address.rsplit(":", 1)
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)
    plain.connect(f"{host}:{port}")
    stranger = ctx.socket(zmq.DEALER)
    pair = load_key_pair(str(keys / "strangers" / "mallory.key_secret"))
    stranger.curve_serverkey = load_key_pair(str(keys / "server" / "server.key_secret")).public
    stranger.curve_publickey, stranger.curve_secretkey = pair.public, pair.secret
    stranger.connect(f"{host}:{port}")
    for sock in (plain, stranger):
        for _ in range(20):
            sock.send(b"\x92\xa4beat" + b"\x91" * 1000 + b"\x90", flags=zmq.NOBLOCK)  # never decoded
    time.sleep(2.0)
    ctx.destroy(linger=0)
    proc.terminate()
    proc.wait(timeout=30)
    log = proc.stderr.read()
    assert "refused a client whose CURVE key is not authorised" in log
    assert "the CURVE handshake failed" in log
    assert "dropped a" not in log  # no frame of theirs reached the decoder


def test_key_files_readable_by_others_are_refused(tiny_path, keys):
    loose = keys / "loose"
    make_key_pair(str(loose), "bob")
    os.chmod(loose / "bob.key_secret", 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        LLM(tiny_path, core_address="tcp://127.0.0.1:5999", **curve_args(keys, "loose/bob"))
    result = run_daemon_command(
        "--model", tiny_path, "--address", "tcp://0.0.0.0:5999", "--allow-remote",
        "--curve-secret-key", str(loose / "bob.key_secret"), "--authorized-clients", str(keys / "authorized"),
    )
    assert result.returncode == 2 and "chmod 600" in result.stderr


def test_a_remote_address_without_curve_stays_refused(tiny_path):
    result = run_daemon_command("--model", tiny_path, "--address", "tcp://0.0.0.0:5999", "--allow-remote")
    assert result.returncode == 2 and "needs --allow-remote with CURVE" in result.stderr
