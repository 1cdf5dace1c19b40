"""Starting and stopping a spawned engine core (frontend process): the `python -m coreserve.engine_core` command
line, and the teardown that `MPClient`'s finalizer runs (a goodbye, the sockets, the process, its folder)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from coreserve.protocol.config import EngineConfig

logger = logging.getLogger("coreserve.frontend.clients.core_client")  # the startup lines keep their logger's name


def spawn_core(config: EngineConfig, address: str, error_path: str) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = [
        sys.executable,
        "-m",
        "coreserve.engine_core",
        "--address",
        address,
        "--log-level",
        _core_log_level(),
        "--config-json",
        msgspec.json.encode(config).decode(),
        "--parent-pid",
        str(os.getpid()),
        "--error-file",
        error_path,
    ]
    logger.info("startup: spawning the engine core at %.3f (unix)", time.time())
    # A session of its own: a SIGTERM or Ctrl+C sent to this process's group (systemd, a terminal) reaches
    # this process alone, which drains and then stops the core (close_connection); a core whose parent
    # dies stops by itself (--parent-pid, checked each second).
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def _core_log_level() -> str:
    """WARNING, unless this process set a level on the `coreserve.engine_core` logger or on `coreserve`:
    then the core's is that."""
    level = logging.getLogger("coreserve.engine_core").level or logging.getLogger("coreserve").level
    return logging.getLevelName(level) if level else "WARNING"


def close_connection(
    ctx: zmq.Context,
    sockets: list[zmq.Socket],
    proc: subprocess.Popen | None,
    tmpdir: str | None,
    goodbye: bytes,
) -> None:
    try:
        sockets[0].send(goodbye, flags=zmq.NOBLOCK)  # the input socket
    except zmq.ZMQError:
        pass
    for sock in sockets:
        sock.close(linger=500)  # long enough for a goodbye to reach a daemon, never a hang
    ctx.term()
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)
