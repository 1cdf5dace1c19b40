"""AsyncLLM: the asyncio face of the engine (frontend process).

The core client and the output processing (detokenizing, logprob dicts, stop strings) live on one
engine thread, so the event loop only hands requests over and receives finished RequestOutput deltas;
a pipe wakes the engine thread when a request or an abort arrives.

Every submission gets its own key (the user's request id plus a serial number): outputs are routed by
that key, so a request id reused after a cancel never receives the old request's last output. An error
in one request's command or output fails that request alone; only a dead core fails them all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from dataclasses import dataclass

from frontend.engine_parts import build_engine_parts
from frontend.errors import EngineDeadError, RequestFailedError
from frontend.input_processor import PromptType
from frontend.outputs import RequestOutput
from frontend.request_stream import RequestStream
from frontend.token_text import TokenTable
from protocol.messages import EngineStats, HandshakeReply
from protocol.model_facts import generation_defaults
from protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0


@dataclass
class _Stream:
    request_id: str  # the user's id, put back on every output
    outputs: asyncio.Queue  # RequestOutput deltas, or the exception that ends the stream


class AsyncLLM:
    """`async for out in engine.generate(prompt, params, request_id)` yields each step's new tokens, text
    and logprobs; leaving the loop early (break, cancel) aborts the request and frees its KV blocks."""

    def __init__(
        self,
        model: str | None = None,
        *,
        multiprocess: bool = True,
        core_address: str | list[str] | None = None,
        **engine_args,
    ) -> None:
        self._parts = build_engine_parts(model, multiprocess, core_address, engine_args)
        self.config, self.tokenizer = self._parts.config, self._parts.tokenizer
        self.facts: HandshakeReply = self._parts.inputs.facts  # the limits requests are checked against
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._streams: dict[str, _Stream] = {}  # submission key -> stream
        self._key_of: dict[str, str] = {}  # user request id -> key of its submission in flight
        self._serials = itertools.count()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._is_stopping = threading.Event()
        self._thread = threading.Thread(target=self._engine_thread, name="coreserve-engine", daemon=True)
        self._thread.start()

    def get_tokenizer(self):
        return self.tokenizer

    @property
    def token_table(self) -> TokenTable:
        """Each token id's bytes and text, as the output processor renders them (read-only)."""
        return self._parts.outputs.table

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults, as `LLM.get_default_sampling_params`; used when
        `generate` is given no SamplingParams."""
        return SamplingParams(**generation_defaults(self.config.model))

    @property
    def is_dead(self) -> bool:
        """The core died, hung or failed (or the engine was shut down): no request can finish."""
        return self._error is not None

    @property
    def dead_reason(self) -> str | None:
        return None if self._error is None else str(self._error)

    def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """An async iterator of the request's deltas, submitted at its first `__anext__`. Its id is free
        again as soon as the stream ends: finished, failed, `aclose()`d, cancelled, or left by `break`."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        return RequestStream(lambda: self._start(prompt, params, request_id), self._release)

    def _start(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> tuple[str, asyncio.Queue]:
        self._raise_if_dead()
        self._loop = asyncio.get_running_loop()
        if request_id in self._key_of:
            raise ValueError(f"request id {request_id!r} is already in flight")
        text, token_ids = self._parts.inputs.process(prompt, params)
        key = f"{request_id}@{next(self._serials)}"
        stream = _Stream(request_id, asyncio.Queue())
        self._streams[key], self._key_of[request_id] = stream, key
        self._submit(("add", key, text, token_ids, params))
        return key, stream.outputs

    def _release(self, key: str, is_finished: bool) -> None:
        """Synchronous, on the event loop (or in a finalizer): the id is free before the next statement."""
        stream = self._streams.pop(key, None)
        if stream is not None and self._key_of.get(stream.request_id) == key:
            del self._key_of[stream.request_id]
        if not is_finished:
            self._submit(("abort", key))

    async def abort(self, request_id: str) -> None:
        key = self._key_of.get(request_id)
        if key is not None:
            self._submit(("abort", key))

    async def get_engine_stats(self) -> EngineStats:
        """The core's state (engine-wide), taken between two steps after everything sent before."""
        self._raise_if_dead()
        future = asyncio.get_running_loop().create_future()
        self._loop = asyncio.get_running_loop()
        self._submit(("stats", future))
        return await future

    def shutdown(self) -> None:
        if self._is_stopping.is_set():
            return
        self._is_stopping.set()
        os.write(self._wake_write, b"\0")
        self._thread.join(timeout=30)
        self._parts.client.shutdown()
        os.close(self._wake_read)
        os.close(self._wake_write)
        if self._error is None:  # streams still open learn that the engine is gone
            self._error = EngineDeadError("the engine was shut down")
            self._deliver_to_all(self._error)

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(str(self._error))

    def _submit(self, command: tuple) -> None:
        if self._is_stopping.is_set():
            return
        self._commands.put(command)
        os.write(self._wake_write, b"\0")

    # ---- engine thread -------------------------------------------------------------------------------

    def _engine_thread(self) -> None:
        client, processor = self._parts.client, self._parts.outputs
        try:
            while not self._is_stopping.is_set():
                self._run_commands()
                timeout = 0.05 if processor.has_unfinished() else _IDLE_WAIT_S
                outputs = client.get_outputs(timeout, self._wake_read)
                processed = processor.process(outputs, client.take_lost())
                client.abort(processed.to_abort)
                for key, error in processed.errors.items():
                    self._deliver(key, error)
                if processed.outputs:
                    self._deliver_outputs(processed.outputs)
        except BaseException as exc:  # the core died or hung (or a bug here): every open stream fails
            self._error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc))
            self._deliver_to_all(self._error)
            logger.error("engine thread stopped: %s", exc)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "abort":
                core_ids, last_output = self._parts.outputs.abort(command[1])
                self._parts.client.abort(core_ids)
                if last_output is not None:  # a stream still listening ends with finish_reason "abort"
                    self._deliver_outputs([last_output])
            elif command[0] == "stats":
                self._answer_stats(command[1])

    def _add(self, key: str, text: str | None, token_ids: list[int], params: SamplingParams) -> None:
        """One request's failure (a field changed since validation, a bug) fails that request alone."""
        parts = self._parts
        try:
            parts.inputs.validate(token_ids, params)
            children = parts.outputs.add_request(key, text, token_ids, params, is_delta=True)
            requests = [parts.inputs.make_request(core_id, token_ids, p) for core_id, p in children]
        except Exception as exc:
            parts.outputs.abort(key)
            self._deliver(key, exc if isinstance(exc, ValueError) else RequestFailedError(repr(exc)))
            return
        parts.client.send(requests)  # raises only when the core is dead: that fails every stream

    def _answer_stats(self, future: asyncio.Future) -> None:
        try:
            stats = self._parts.client.get_stats()
        except BaseException as exc:  # a dead core: the caller learns it, then every stream does
            error = exc
            self._loop.call_soon_threadsafe(lambda: future.done() or future.set_exception(error))
            raise
        self._loop.call_soon_threadsafe(lambda: future.done() or future.set_result(stats))

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put_outputs, outputs)

    def _deliver(self, key: str, error: BaseException) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put_error, key, error)

    def _deliver_to_all(self, error: BaseException) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put_error, None, error)

    # ---- event loop ----------------------------------------------------------------------------------

    def _put_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)  # keyed by submission: a closed one is gone
            if stream is not None:
                output.request_id = stream.request_id
                stream.outputs.put_nowait(output)

    def _put_error(self, key: str | None, error: BaseException) -> None:
        streams = list(self._streams.values()) if key is None else [self._streams.get(key)]
        for stream in streams:
            if stream is not None:
                stream.outputs.put_nowait(error)
