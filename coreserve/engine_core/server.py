"""The core's ZeroMQ face (engine-core process): an input thread decodes client frames, the busy loop
steps the engine, an output thread encodes and sends. Each socket is used by exactly one thread.

Clients are told apart by their routing id; each receives only its own outputs, and only after its
handshake succeeded. A client silent for longer than `client_timeout_s` (no heartbeat) has its
requests aborted and their KV blocks freed. A thread that dies stops the core, which tells its clients
why and exits non-zero: no thread dies silently while the others go on.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from coreserve.engine_core.core import EngineCore
from coreserve.engine_core.curve_auth import CurveServer
from coreserve.engine_core.endpoints import Endpoints
from coreserve.engine_core.inbound import DecodedRequests, FrameReader
from coreserve.protocol.codec import Codec
from coreserve.protocol.curve_keys import KeyPair
from coreserve.protocol.messages import (
    AbortRequests,
    ControlCommand,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineError,
    FinishReason,
    GetStats,
    Goodbye,
    Heartbeat,
)

logger = logging.getLogger(__name__)

MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere
_heap_releases = 0  # malloc_trim calls made by release_heap in this process


def release_heap() -> float:
    """Hands the free pages of the C heap back to the OS (glibc's malloc_trim): a step's activations
    are freed, but glibc keeps them, and a burst of prefill left ~100 MiB resident after it ended
    (SmolLM2, 32 prompts). Called when the core goes idle, so no step waits on it. Returns its seconds
    (0 where the C library has no malloc_trim)."""
    if MALLOC_TRIM is None:
        return 0.0
    global _heap_releases
    begun = time.perf_counter()
    MALLOC_TRIM(ctypes.c_size_t(0))  # ctypes drops the GIL: the output thread goes on sending
    _heap_releases += 1
    return time.perf_counter() - begun


def heap_releases() -> int:
    """How many times release_heap gave the heap back in this process (the engine stats' count)."""
    return _heap_releases

HEARTBEAT_INTERVAL_S = 0.5
HANG_AFTER_S = 15.0  # a busy loop stuck this long stops the heartbeats, so clients declare it dead
POLL_MS = 100


class ProgressClock:
    """When the busy loop last moved: each of its turns, and within a step each model layer and window
    step (`mark` is the EngineCore's on_progress). The heartbeats vouch for it while it is recent."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def mark(self) -> None:
        self.last = time.monotonic()


class CoreServer:
    def __init__(
        self,
        core: EngineCore,
        address: str,
        parent_pid: int | None = None,
        client_timeout_s: float = 30.0,
        curve: tuple[KeyPair, str] | None = None,  # the server's keys, the folder of authorised client keys
        progress: ProgressClock | None = None,  # the one the core was built with; None: loop turns only
    ) -> None:
        self.core = core
        self.progress = progress or ProgressClock()
        self.parent_pid = parent_pid
        self.client_timeout_s = client_timeout_s
        self.ctx = zmq.Context()
        curve_server = None
        try:
            curve_server = CurveServer(self.ctx, *curve) if curve is not None else None
            self.endpoints = Endpoints(self.ctx, address, curve_server)
        except BaseException:
            if curve_server is not None:
                curve_server.stop()
            self.ctx.destroy(linger=0)
            raise
        self.in_socket, self.out_socket = self.endpoints.in_socket, self.endpoints.out_socket
        self.reader = FrameReader(core.facts, core.tokenizer_fingerprint)
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.last_seen: dict[bytes, float] = {}  # greeted client -> monotonic time of its last frame
        self.is_stopping = threading.Event()
        self.thread_failure: str | None = None  # why a thread of the core died, if one did

    def serve_forever(self) -> None:
        threads = [
            threading.Thread(target=self._guard(self._input_loop), name="core-input", daemon=True),
            threading.Thread(target=self._guard(self._output_loop), name="core-output", daemon=True),
        ]
        for thread in threads:
            thread.start()
        try:
            self._busy_loop()
        except Exception as exc:  # a bug, a device failure or a dead thread: tell every client, then exit
            logger.exception("engine core failed")
            for client in list(self.last_seen):
                self.outputs.put((client, EngineError(f"engine core failed: {exc}")))
            raise
        finally:
            self.is_stopping.set()
            self.outputs.put(None)  # queued after the error messages: they are sent first
            for thread in threads:
                thread.join(timeout=5)
            self.endpoints.close()  # lingers a moment so that those last frames leave
            self.ctx.term()

    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        """A thread's loop that, if it dies, makes the busy loop stop the core with the reason."""

        def run() -> None:
            try:
                loop()
            except BaseException as exc:
                logger.exception("thread %s died", threading.current_thread().name)
                self.thread_failure = f"thread {threading.current_thread().name} died: {exc!r}"

        return run

    def stop(self) -> None:
        self.is_stopping.set()

    # ---- busy loop (main thread) ---------------------------------------------------------------------

    def _busy_loop(self) -> None:
        next_check = 0.0
        while not self.is_stopping.is_set():
            if self.thread_failure is not None:
                raise RuntimeError(self.thread_failure)
            self.progress.mark()
            self._drain_inputs(block=not self.core.has_unfinished_requests())
            if self.core.has_unfinished_requests():
                for client, outputs in self.core.step().items():
                    outputs.timestamp = time.time()
                    self.outputs.put((client, outputs))
                if not self.core.has_unfinished_requests():  # idle now: the outputs are queued first
                    logger.debug("heap released in %.4f s", release_heap())
            self.core.control.poll(self._outbox)  # a command waiting for running requests to finish
            self.core.publish_kv_events()  # a command's clear, when no step follows it
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
        """One message; an unexpected error while handling it drops it alone (logged), never the core."""
        try:
            self._handle_one(client, message)
        except Exception:
            logger.exception("could not handle a %s from client %s", type(message).__name__, client.hex())

    def _handle_one(self, client: bytes, message) -> None:
        if isinstance(message, AbortRequests):
            self.core.abort_requests(client, message.req_ids)
        elif isinstance(message, GetStats):  # here, in order after this client's earlier messages
            stats = msgspec.structs.replace(self.core.stats(message.nonce), num_heap_releases=heap_releases())
            self.outputs.put((client, stats))
        elif isinstance(message, Goodbye):
            self.core.abort_client(client)
            self.last_seen.pop(client, None)
        elif isinstance(message, ControlCommand):  # coreserve/engine_core/rl_control.py: between two steps
            self.core.control.submit(client, message, self._outbox)
        elif isinstance(message, DecodedRequests):
            refusals = [r for r in (self._add(client, req) for req in message.requests) if r is not None]
            if refusals:
                self.outputs.put((client, EngineCoreOutputs(refusals, time.time())))

    def _outbox(self, client: bytes, message) -> None:
        self.outputs.put((client, message))

    def _add(self, client: bytes, request: EngineCoreRequest) -> EngineCoreOutput | None:
        try:
            return self.core.add_request(client, request)
        except Exception as exc:  # a bug: this request is refused, with the reason, and the rest go on
            logger.exception("could not add request %s", request.req_id)
            error = f"the engine core could not take the request: {exc!r}"
            return EngineCoreOutput(request.req_id, [], finish_reason=FinishReason.ERROR, error=error)

    def _check_liveness(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.warning("the frontend that spawned this core is gone; shutting down")
            self.is_stopping.set()
        deadline = time.monotonic() - self.client_timeout_s
        for client, seen in list(self.last_seen.items()):
            if seen < deadline:
                aborted = self.core.abort_client(client)
                self.last_seen.pop(client, None)
                if aborted:  # if it is only slow, it learns what happened instead of waiting forever
                    logger.warning(
                        "client %s went silent; aborted its %d requests", client.hex(), len(aborted)
                    )
                    outputs = [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in aborted]
                    self.outputs.put((client, EngineCoreOutputs(outputs, time.time())))

    # ---- input thread --------------------------------------------------------------------------------

    def _input_loop(self) -> None:
        while not self.is_stopping.is_set():
            self.endpoints.log_refusals()
            if not self.in_socket.poll(POLL_MS):
                continue
            frames = self.in_socket.recv_multipart(copy=False)
            client = bytes(frames[0].buffer)
            inbound = self.reader.read(client, frames[-1].buffer)
            if client in self.reader.greeted:
                self.last_seen[client] = time.monotonic()
            if inbound.reply is not None:
                self.outputs.put((client, inbound.reply))
            if inbound.to_core is not None:
                self.inputs.put((client, inbound.to_core))

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
            self._discard_inbound()
            is_alive = time.monotonic() - self.progress.last < HANG_AFTER_S  # heartbeats vouch for the loop
            if time.monotonic() >= next_beat and is_alive:
                for client in list(self.last_seen):
                    self._send(client, beat)
                next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S

    def _discard_inbound(self) -> None:
        """Nothing legitimate arrives on the output socket: whatever does is read and thrown away."""
        while self.out_socket.poll(0, zmq.POLLIN):
            self.out_socket.recv_multipart(copy=False)

    def _send(self, client: bytes, frame: bytes) -> None:
        try:
            self.out_socket.send_multipart([client, frame], copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client is not (or no longer) connected
            logger.debug("could not send to client %s: %s", client.hex(), exc)
