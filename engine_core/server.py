"""The core's ZeroMQ face (engine-core process): an input thread decodes client frames, the busy loop
steps the engine, an output thread encodes and sends. Each socket is used by exactly one thread.

Clients are told apart by their routing id; each receives only its own outputs. A client silent for
longer than `client_timeout_s` (no heartbeat) has its requests aborted and their KV blocks freed.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import msgspec
import zmq

from engine_core.core import EngineCore
from protocol import PROTOCOL_VERSION
from protocol.addresses import split_address
from protocol.codec import Codec
from protocol.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineError,
    FinishReason,
    GetStats,
    Goodbye,
    HandshakeReply,
    Heartbeat,
    Hello,
)

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
HANG_AFTER_S = 15.0  # a busy loop stuck this long stops the heartbeats, so clients declare it dead
POLL_MS = 100


class CoreServer:
    def __init__(
        self, core: EngineCore, address: str, parent_pid: int | None = None, client_timeout_s: float = 30.0
    ) -> None:
        self.core = core
        self.parent_pid = parent_pid
        self.client_timeout_s = client_timeout_s
        self.ctx = zmq.Context()
        in_address, out_address = split_address(address)
        self.in_socket = self._bind(zmq.ROUTER, in_address)
        self.out_socket = self._bind(zmq.ROUTER, out_address)
        self.out_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a silent drop
        self.out_socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow client's outputs
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.last_seen: dict[bytes, float] = {}  # client -> monotonic time of its last frame
        self.is_stopping = threading.Event()
        self.last_progress = time.monotonic()  # the busy loop's last turn; heartbeats vouch for it
        core.runner.on_model_step = self._mark_progress  # a window's steps count as turns

    def _bind(self, kind: int, address: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    def serve_forever(self) -> None:
        threads = [
            threading.Thread(target=self._input_loop, name="core-input", daemon=True),
            threading.Thread(target=self._output_loop, name="core-output", daemon=True),
        ]
        for thread in threads:
            thread.start()
        try:
            self._busy_loop()
        except Exception as exc:  # a bug or a device failure: tell every client, then exit
            logger.exception("engine core failed")
            for client in list(self.last_seen):
                self.outputs.put((client, EngineError(f"engine core failed: {exc!r}")))
            raise
        finally:
            self.is_stopping.set()
            self.outputs.put(None)
            for thread in threads:
                thread.join(timeout=5)
            self.in_socket.close()
            self.out_socket.close()
            self.ctx.term()

    def _mark_progress(self) -> None:
        self.last_progress = time.monotonic()

    def stop(self) -> None:
        self.is_stopping.set()

    # ---- busy loop (main thread) ---------------------------------------------------------------------

    def _busy_loop(self) -> None:
        next_check = 0.0
        while not self.is_stopping.is_set():
            self._mark_progress()
            self._drain_inputs(block=not self.core.has_unfinished_requests())
            if self.core.has_unfinished_requests():
                for client, outputs in self.core.step().items():
                    outputs.timestamp = time.time()
                    self.outputs.put((client, outputs))
            if time.monotonic() >= next_check:
                self._check_liveness()
                next_check = time.monotonic() + 1.0

    def _drain_inputs(self, block: bool) -> None:
        try:
            item = self.inputs.get(timeout=0.2) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.inputs.get_nowait()
            except queue.Empty:
                return

    def _handle(self, client: bytes, message) -> None:
        if isinstance(message, AbortRequests):
            self.core.abort_requests(client, message.req_ids)
        elif isinstance(message, GetStats):  # here, in order after this client's earlier messages
            self.outputs.put((client, self.core.stats(message.nonce)))
        elif isinstance(message, Goodbye):
            self.core.abort_client(client)
            self.last_seen.pop(client, None)
        elif isinstance(message, AddRequests):
            requests = message.requests
            refusals = [r for r in (self.core.add_request(client, req) for req in requests) if r is not None]
            if refusals:
                self.outputs.put((client, EngineCoreOutputs(refusals, time.time())))

    def _check_liveness(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.warning("the frontend that spawned this core is gone; shutting down")
            self.is_stopping.set()
        deadline = time.monotonic() - self.client_timeout_s
        for client, seen in list(self.last_seen.items()):
            if seen < deadline:
                aborted = self.core.abort_client(client)
                del self.last_seen[client]
                if aborted:  # if it is only slow, it learns what happened instead of waiting forever
                    logger.warning(
                        "client %s went silent; aborted its %d requests", client.hex(), len(aborted)
                    )
                    outputs = [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in aborted]
                    self.outputs.put((client, EngineCoreOutputs(outputs, time.time())))

    # ---- input thread --------------------------------------------------------------------------------

    def _input_loop(self) -> None:
        codec = Codec()
        while not self.is_stopping.is_set():
            if not self.in_socket.poll(POLL_MS):
                continue
            frames = self.in_socket.recv_multipart(copy=False)
            client = bytes(frames[0].buffer)
            try:
                message = codec.decode_client(frames[-1].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropped a malformed frame from client %s: %s", client.hex(), exc)
                continue
            self.last_seen[client] = time.monotonic()
            if isinstance(message, Hello):
                self.outputs.put((client, self._handshake(message)))
            else:
                self.inputs.put((client, message))

    def _handshake(self, hello: Hello) -> HandshakeReply:
        reply = self.core.facts()
        if hello.protocol_version != PROTOCOL_VERSION:
            reply.error = f"protocol version {hello.protocol_version} != the core's {PROTOCOL_VERSION}"
        elif hello.tokenizer_fingerprint != self.core.tokenizer_fingerprint:
            reply.error = "the frontend's tokenizer does not match the model's tokenizer"
        return reply

    # ---- output thread -------------------------------------------------------------------------------

    def _output_loop(self) -> None:
        codec = Codec()
        beat = codec.encode(Heartbeat())
        next_beat = time.monotonic()
        while True:
            try:
                item = self.outputs.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                client, message = item
                self._send(client, codec.encode(message))
            is_alive = time.monotonic() - self.last_progress < HANG_AFTER_S  # heartbeats vouch for the loop
            if time.monotonic() >= next_beat and is_alive:
                for client in list(self.last_seen):
                    self._send(client, beat)
                next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S

    def _send(self, client: bytes, frame: bytes) -> None:
        try:
            self.out_socket.send_multipart([client, frame], copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client is not (or no longer) connected
            logger.debug("could not send to client %s: %s", client.hex(), exc)
