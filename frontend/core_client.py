"""Clients of the engine core (frontend process): `MPClient` talks to a core process over ZeroMQ, one it
spawns or a running daemon; `InprocClient` runs the same EngineCore in this process, for debugging.
Both offer send/abort/get_outputs/shutdown.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path

import msgspec
import zmq

from frontend.errors import EngineDeadError
from protocol import PROTOCOL_VERSION
from protocol.addresses import split_address
from protocol.codec import Codec
from protocol.config import EngineConfig
from protocol.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineError,
    EngineStats,
    GetStats,
    Goodbye,
    HandshakeReply,
    Heartbeat,
    Hello,
)

logger = logging.getLogger(__name__)

POLL_MS = 100
HEARTBEAT_EVERY_S = 1.0


class MPClient:
    """Spawns `python -m engine_core` (address None) or connects to a daemon at `address`."""

    def __init__(
        self,
        config: EngineConfig,
        fingerprint: str,
        address: str | None = None,
        startup_timeout_s: float = 300.0,
        dead_after_s: float = 10.0,
    ) -> None:
        self.codec = Codec()
        self.dead_after_s = dead_after_s
        self.error: str | None = None
        self.ctx = zmq.Context()
        self.proc, self.tmpdir = None, None
        if address is None:
            self.tmpdir = tempfile.mkdtemp(prefix="coreserve-")
            address = f"ipc://{self.tmpdir}/core"
            self.proc = _spawn_core(config, address)
        self.client_id = uuid.uuid4().bytes
        in_address, out_address = split_address(address)
        self.out_socket = self._connect(zmq.DEALER, out_address)  # outputs arrive here
        self.in_socket = self._connect(zmq.DEALER, in_address)  # requests leave here
        self._finalizer = weakref.finalize(
            self, _cleanup, self.ctx, [self.in_socket, self.out_socket], self.proc, self.tmpdir
        )
        self.last_heard = time.monotonic()
        self.last_beat_sent = 0.0
        self.stats: EngineStats | None = None  # the latest answer to GetStats
        self.stats_nonce = 0
        self.pending: list[EngineCoreOutput] = []  # outputs drained while waiting for stats
        self.facts = self._handshake(fingerprint, startup_timeout_s)

    def _connect(self, kind: int, address: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.client_id)
        sock.connect(address)
        return sock

    def _handshake(self, fingerprint: str, timeout_s: float) -> HandshakeReply:
        deadline, next_hello = time.monotonic() + timeout_s, 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_hello:  # repeated until the core's output socket knows us
                self.in_socket.send(self.codec.encode(Hello(PROTOCOL_VERSION, fingerprint)))
                next_hello = time.monotonic() + 0.5
            self._check_process()
            if self.error is not None:
                self.shutdown()
                raise EngineDeadError(f"the engine core failed to start: {self.error}")
            if self.out_socket.poll(POLL_MS):
                try:
                    message = self.codec.decode_core(self.out_socket.recv())
                except msgspec.DecodeError:  # a core of another protocol version: its reply says so
                    continue
                if isinstance(message, HandshakeReply):
                    if message.error:
                        self.shutdown()
                        raise ValueError(f"the engine core refused this frontend: {message.error}")
                    self.last_heard = time.monotonic()
                    return message
        self.shutdown()
        raise EngineDeadError(f"the engine core did not answer within {timeout_s:.0f} s")

    def send(self, requests: list[EngineCoreRequest]) -> None:
        self._raise_if_dead(is_waiting=False)
        self.in_socket.send(self.codec.encode(AddRequests(requests)), copy=False)
        # Silence while we were idle proves nothing; from this send on the core owes us heartbeats.
        self.last_heard = max(self.last_heard, time.monotonic())

    def abort(self, req_ids: list[str]) -> None:
        if req_ids and self.error is None:
            self.in_socket.send(self.codec.encode(AbortRequests(req_ids)))

    def get_outputs(self, timeout_s: float, wake_fd: int | None = None) -> list[EngineCoreOutput]:
        """Waits up to `timeout_s` for outputs, or until `wake_fd` (a pipe) becomes readable; raises
        EngineDeadError when the core is gone."""
        if self.pending:  # drained while waiting for stats: delivered first, at once
            outputs, self.pending = self.pending, []
            return outputs
        deadline = time.monotonic() + timeout_s
        while True:
            self._raise_if_dead(is_waiting=True)
            now = time.monotonic()
            if now - self.last_beat_sent >= HEARTBEAT_EVERY_S:
                self.in_socket.send(self.codec.encode(Heartbeat()))
                self.last_beat_sent = now
            is_woken = self._wait(min(POLL_MS, max(0, int((deadline - now) * 1000))), wake_fd)
            outputs = self._drain()
            if outputs or is_woken or time.monotonic() >= deadline:
                return outputs

    def _wait(self, wait_ms: int, wake_fd: int | None) -> bool:
        """Blocks until a frame arrives, `wake_fd` is readable, or `wait_ms` pass; True when woken."""
        if wake_fd is None:
            self.out_socket.poll(wait_ms)
            return False
        poller = zmq.Poller()
        poller.register(self.out_socket, zmq.POLLIN)
        poller.register(wake_fd, zmq.POLLIN)
        if wake_fd in dict(poller.poll(wait_ms)):
            os.read(wake_fd, 4096)
            return True
        return False

    def get_stats(self) -> EngineStats:
        """The core's state after everything this client sent before (its aborts included), taken by
        the core between two steps; waits as long as the core is alive (a window or a long prefill
        delays the answer). Not thread-safe, like the rest of this client: not while another thread
        is in get_outputs."""
        self._raise_if_dead(is_waiting=False)
        self.stats_nonce += 1
        self.in_socket.send(self.codec.encode(GetStats(self.stats_nonce)))
        self.last_heard = max(self.last_heard, time.monotonic())
        while self.stats is None or self.stats.nonce != self.stats_nonce:
            self._raise_if_dead(is_waiting=True)
            self.out_socket.poll(POLL_MS)
            self.pending.extend(self._drain())  # handed out by the next get_outputs
        return self.stats

    def _drain(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        while self.out_socket.poll(0):
            message = self.codec.decode_core(self.out_socket.recv(copy=False).buffer)
            self.last_heard = time.monotonic()
            if isinstance(message, EngineCoreOutputs):
                outputs.extend(message.outputs)
            elif isinstance(message, EngineStats):
                self.stats = message
            elif isinstance(message, EngineError):
                self.error = message.message
        return outputs

    def _check_process(self, is_waiting: bool = False) -> None:
        """A spawned core that exited is dead; so is any core silent for dead_after_s while we wait on it."""
        if self.proc is not None and self.proc.poll() is not None:
            self.error = f"the engine core process exited with code {self.proc.returncode}"
        elif is_waiting and self.error is None and time.monotonic() - self.last_heard > self.dead_after_s:
            self.error = f"no word from the engine core for {self.dead_after_s:.0f} s"

    def _raise_if_dead(self, is_waiting: bool) -> None:
        self._check_process(is_waiting)
        if self.error is not None:
            raise EngineDeadError(self.error)

    def shutdown(self) -> None:
        if self._finalizer.alive and self.error is None:
            try:
                self.in_socket.send(self.codec.encode(Goodbye()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._finalizer()


def _spawn_core(config: EngineConfig, address: str) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = [
        sys.executable,
        "-m",
        "engine_core",
        "--address",
        address,
        "--log-level",
        "WARNING",
        "--config-json",
        msgspec.json.encode(config).decode(),
        "--parent-pid",
        str(os.getpid()),
    ]
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)


def _cleanup(
    ctx: zmq.Context, sockets: list[zmq.Socket], proc: subprocess.Popen | None, tmpdir: str | None
) -> None:
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


class InprocClient:
    """The same EngineCore in this process, stepped by get_outputs; no sockets (debugging)."""

    def __init__(self, config: EngineConfig, fingerprint: str) -> None:
        from engine_core.core import (
            EngineCore,  # in-process mode only: the one place the frontend holds a core
        )

        self.core = EngineCore(config)
        if self.core.tokenizer_fingerprint != fingerprint:
            raise ValueError(
                "the engine core refused this frontend: its tokenizer does not match the model's"
            )
        self.facts = self.core.facts()
        self.client_id = b""
        self.pending: list[EngineCoreOutput] = []

    def send(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            refusal = self.core.add_request(self.client_id, request)
            if refusal is not None:
                self.pending.append(refusal)

    def abort(self, req_ids: list[str]) -> None:
        self.core.abort_requests(self.client_id, req_ids)

    def get_stats(self) -> EngineStats:
        return self.core.stats()

    def get_outputs(self, timeout_s: float, wake_fd: int | None = None) -> list[EngineCoreOutput]:
        outputs, self.pending = self.pending, []
        if not outputs and not self.core.has_unfinished_requests():
            if wake_fd is not None and select.select([wake_fd], [], [], timeout_s)[0]:
                os.read(wake_fd, 4096)
            return outputs
        for batch in self.core.step().values():
            outputs.extend(batch.outputs)
        return outputs

    def shutdown(self) -> None:
        self.core = None
