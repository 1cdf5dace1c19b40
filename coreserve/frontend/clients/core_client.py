"""The client of an engine core process (frontend process): `MPClient` talks to a core over ZeroMQ, one
it spawns or a running daemon. `InprocClient` (coreserve/frontend/clients/inproc_client.py) and `MultiCoreClient`
(several daemons) offer the same send/abort/get_outputs/take_lost/get_stats/shutdown.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass

import msgspec
import zmq

from coreserve.frontend.clients.client_protocol import add_spec_counts
from coreserve.frontend.clients.core_process import close_connection, spawn_core
from coreserve.frontend.errors import EngineDeadError
from coreserve.protocol import PROTOCOL_VERSION
from coreserve.protocol.addresses import split_address
from coreserve.protocol.codec import Codec
from coreserve.protocol.config import EngineConfig
from coreserve.protocol.curve_keys import KeyPair
from coreserve.protocol.limits import MAX_TOKENS_PER_FRAME
from coreserve.protocol.messages import (
    AbortRequests,
    ControlCommand,
    ControlReply,
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
ATTACH_TIMEOUT_S = 15.0  # a daemon answers a hello at once; a spawned core first loads its model


@dataclass(frozen=True)
class ClientCurve:
    """CURVE keys for a daemon that requires them: its public key and this client's key pair."""

    server_public: bytes
    keys: KeyPair


class MPClient:
    """Spawns `python -m coreserve.engine_core` (address None) or connects to a daemon at `address`."""

    def __init__(
        self,
        config: EngineConfig,
        fingerprint: str,
        address: str | None = None,
        startup_timeout_s: float | None = None,
        dead_after_s: float = 10.0,
        curve: ClientCurve | None = None,
    ) -> None:
        if startup_timeout_s is None:
            startup_timeout_s = 300.0 if address is None else ATTACH_TIMEOUT_S
        self.address = address
        self.curve = curve
        self.codec = Codec()
        self.dead_after_s = dead_after_s
        self.error: str | None = None
        self.ctx = zmq.Context()
        self.proc, self.tmpdir = None, None
        if address is None:
            self.tmpdir = tempfile.mkdtemp(prefix="coreserve-")
            address = f"ipc://{self.tmpdir}/core"
            self.proc = spawn_core(config, address, self._error_path())
        self.client_id = uuid.uuid4().bytes
        in_address, out_address = split_address(address)
        self.out_socket = self._connect(zmq.DEALER, out_address)  # outputs arrive here
        self.in_socket = self._connect(zmq.DEALER, in_address)  # requests leave here
        # At shutdown, garbage collection or interpreter exit: a goodbye, so that a daemon aborts what
        # this client leaves behind at once instead of after its silence timeout.
        self._sockets = [self.in_socket, self.out_socket]  # closed by the finalizer, the monitor too
        self._finalizer = weakref.finalize(
            self,
            close_connection,
            self.ctx,
            self._sockets,
            self.proc,
            self.tmpdir,
            self.codec.encode(Goodbye()),
        )
        self.monitor: zmq.Socket | None = None  # after the handshake
        self.last_heard = time.monotonic()
        self.last_beat_sent = 0.0
        self.stats: EngineStats | None = None  # the latest answer to GetStats
        self.stats_nonce = 0
        self.pending: list[EngineCoreOutput] = []  # outputs drained while waiting for stats
        self.spec_counts: dict[str, list[int]] = {}  # speculation's counts, until taken
        self.control_replies: dict[int, ControlReply] = {}  # by nonce, until control() takes its own
        self.facts = self._handshake(fingerprint, startup_timeout_s)
        # A daemon that exits or is killed closes the connection: known at once, not after the silence.
        self.monitor = self.out_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sockets.append(self.monitor)

    def _connect(self, kind: int, address: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.client_id)
        if address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if self.curve is not None:
            sock.curve_serverkey = self.curve.server_public
            sock.curve_publickey = self.curve.keys.public
            sock.curve_secretkey = self.curve.keys.secret
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
        where = f"at {self.address}" if self.address else "it spawned"
        hint = _silence_hint(self.address) if self.address else ""
        if self.curve is not None:
            hint += "; or the daemon refused this client's CURVE key (is it among its authorised clients?)"
        raise EngineDeadError(f"the engine core {where} did not answer within {timeout_s:.0f} s{hint}")

    def send(self, requests: list[EngineCoreRequest]) -> None:
        """Frames of at most about MAX_TOKENS_PER_FRAME prompt tokens (the core caps a frame's size)."""
        self._raise_if_dead(is_waiting=False)
        start, num_tokens = 0, 0
        for end, request in enumerate(requests):
            if num_tokens and num_tokens + len(request.prompt_token_ids) > MAX_TOKENS_PER_FRAME:
                self.in_socket.send(self.codec.encode_requests(requests[start:end]), copy=False)
                start, num_tokens = end, 0
            num_tokens += len(request.prompt_token_ids)
        if start < len(requests):
            self.in_socket.send(self.codec.encode_requests(requests[start:]), copy=False)
        # Silence while we were idle proves nothing; from this send on the core owes us heartbeats.
        self.last_heard = max(self.last_heard, time.monotonic())

    def abort(self, req_ids: list[str]) -> None:
        if req_ids and self.error is None:
            self.in_socket.send(self.codec.encode(AbortRequests(req_ids)))

    def get_outputs(self, timeout_s: float, wake_fd: int | None = None) -> list[EngineCoreOutput]:
        """Waits up to `timeout_s` for outputs, or until `wake_fd` (a pipe) becomes readable; raises
        EngineDeadError when the core is gone."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.tick()
            is_woken = False
            if not self.pending:  # drained while waiting for stats or checking silence: at once
                wait_ms = min(POLL_MS, max(0, int((deadline - time.monotonic()) * 1000)))
                is_woken = wait_for_frames([self.out_socket], wait_ms, wake_fd)
            outputs = self.take_pending() + self.drain()
            if outputs or is_woken or time.monotonic() >= deadline:
                return outputs

    def tick(self) -> None:
        """Raises EngineDeadError when the core is gone; sends a heartbeat when one is due."""
        self._raise_if_dead(is_waiting=True)
        now = time.monotonic()
        if now - self.last_beat_sent >= HEARTBEAT_EVERY_S:
            self.in_socket.send(self.codec.encode(Heartbeat()))
            self.last_beat_sent = now

    def take_pending(self) -> list[EngineCoreOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    def take_lost(self) -> dict[str, str]:
        """Requests lost with a core while others live on: none here (one core's death is everyone's)."""
        return {}

    def take_spec_counts(self) -> dict[str, list[int]]:
        counts, self.spec_counts = self.spec_counts, {}
        return counts

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
            self.pending.extend(self.drain())  # handed out by the next get_outputs
        return self.stats

    def control(self, command: ControlCommand) -> ControlReply:
        """Sends an RL control command (docs/rl.md) and waits for its reply as long as the core lives;
        outputs that arrive meanwhile go to the next get_outputs. `command.nonce` must be unique."""
        self._raise_if_dead(is_waiting=False)
        if not self.facts.has_rl_control:
            raise ValueError("this engine core is older than the RL control commands (update_weights, ...)")
        self.in_socket.send(self.codec.encode(command))
        self.last_heard = max(self.last_heard, time.monotonic())
        while command.nonce not in self.control_replies:
            self.tick()  # heartbeats: an update in "wait" mode may wait for long requests
            self.out_socket.poll(POLL_MS)
            self.pending.extend(self.drain())
        return self.control_replies.pop(command.nonce)

    def drain(self) -> list[EngineCoreOutput]:
        """Whatever the core has sent, without waiting; outputs returned, the rest noted."""
        outputs: list[EngineCoreOutput] = []
        while self.out_socket.poll(0):
            message = self.codec.decode_core(self.out_socket.recv(copy=False).buffer)
            self.last_heard = time.monotonic()
            if isinstance(message, EngineCoreOutputs):
                outputs.extend(message.outputs)
                add_spec_counts(self.spec_counts, message)
            elif isinstance(message, EngineStats):
                self.stats = message
            elif isinstance(message, ControlReply):
                self.control_replies[message.nonce] = message
            elif isinstance(message, EngineError):
                self.error = message.message
        return outputs

    def _check_process(self, is_waiting: bool = False) -> None:
        """A spawned core that exited is dead; so is any core silent for dead_after_s while we wait on it."""
        if self.error is None and self.proc is None and self.monitor is not None and self.monitor.poll(0):
            self._drain_quietly()  # a fatal error's message may have come first
            closed = f"the connection to the engine core at {self.address} closed (it exited or was killed)"
            self.error = closed if self.error is None else f"{self.error} ({closed})"
        if self.proc is not None and self.error is None and self.proc.poll() is not None:
            self._drain_quietly()  # its last frame may say why (an EngineError)
            exited = f"the engine core process exited with code {self.proc.returncode}"
            reason = self.error or self._core_error()
            self.error = exited if reason is None else f"{reason} ({exited})"
        elif is_waiting and self.error is None and time.monotonic() - self.last_heard > self.dead_after_s:
            # Frames waiting unread mean this process, not the core, was too busy to listen.
            self.pending.extend(self.drain())
            if time.monotonic() - self.last_heard > self.dead_after_s:
                self.error = f"no word from the engine core for {self.dead_after_s:.0f} s"

    def _error_path(self) -> str | None:
        return None if self.tmpdir is None else os.path.join(self.tmpdir, "core-error")

    def _core_error(self) -> str | None:
        """The line a spawned core wrote as an error stopped it (coreserve/engine_core/__main__.py's --error-file)."""
        path = self._error_path()
        if path is None or not os.path.exists(path):
            return None  # killed, or it stopped without an exception: the exit code says what is known
        with open(path, errors="replace") as f:
            return f.read().strip() or None

    def _raise_if_dead(self, is_waiting: bool) -> None:
        self._check_process(is_waiting)
        if self.error is not None:
            raise EngineDeadError(self.error)

    def _drain_quietly(self) -> None:
        try:
            self.drain()
        except (msgspec.DecodeError, zmq.ZMQError):
            pass

    def shutdown(self) -> None:
        self._finalizer()


def wait_for_outputs(clients: list[MPClient], wait_ms: int, wake_fd: int | None) -> bool:
    """Blocks until one of `clients` has a frame to read, `wake_fd` is readable, or `wait_ms` pass;
    True when woken through `wake_fd` (MultiCoreClient waits on several cores at once)."""
    return wait_for_frames([client.out_socket for client in clients], wait_ms, wake_fd)


def wait_for_frames(sockets: list[zmq.Socket], wait_ms: int, wake_fd: int | None) -> bool:
    """Blocks until a frame arrives on one of `sockets`, `wake_fd` is readable, or `wait_ms` pass;
    True when woken through `wake_fd`."""
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    if wake_fd is not None:
        poller.register(wake_fd, zmq.POLLIN)
    events = dict(poller.poll(wait_ms))
    if wake_fd is not None and wake_fd in events:
        os.read(wake_fd, 4096)
        return True
    return False


def _silence_hint(address: str) -> str:
    in_address = split_address(address)[0]
    if in_address.startswith("ipc://") and not os.path.exists(in_address[len("ipc://") :]):
        return f" (no socket file {in_address[len('ipc://') :]}: is python -m coreserve.engine_core running there?)"
    return " (is python -m coreserve.engine_core running there?)"
