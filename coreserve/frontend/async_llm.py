"""AsyncLLM: the asyncio face of the engine (frontend process).

The `FrontendEngine` (core client and output processing: detokenizing, logprob dicts, stop strings)
lives on one engine thread, so the event loop only hands it typed commands and receives finished
RequestOutput deltas; a pipe wakes the engine thread when a command arrives.

Every submission gets its own key (the user's request id plus a serial number): outputs are routed by
that key, so a request id reused after a cancel never receives the old request's last output. An error
in one request's command or output fails that request alone; only a dead core fails them all.

Its control verbs (RL: update_weights, sleep, ...) are `AsyncLLMControlVerbs`' (coreserve/frontend/control_verbs.py),
each a `_call` of the FrontendEngine's verb.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from coreserve.frontend.control_verbs import AsyncLLMControlVerbs
from coreserve.frontend.engine.engine import FrontendEngine, PreparedRequest
from coreserve.frontend.engine.input_processor import PromptType
from coreserve.frontend.engine.token_text import TokenTable
from coreserve.frontend.errors import EngineDeadError, RequestFailedError
from coreserve.frontend.lora import LoRARequest, with_lora
from coreserve.frontend.outputs import RequestOutput
from coreserve.frontend.pooling_verbs import pooling_sampling_params
from coreserve.frontend.request_stream import RequestStream
from coreserve.protocol.messages import EngineStats, HandshakeReply
from coreserve.protocol.pooling_params import PoolingParams
from coreserve.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0
_BUSY_WAIT_S = 0.05
T = TypeVar("T")


# ---- the engine thread's commands ---------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request: PreparedRequest  # its request_id is the submission key


@dataclass(frozen=True)
class AbortRequest:
    key: str


@dataclass(frozen=True)
class EngineCall:
    """Runs `method(engine)` on the engine thread; its result or exception settles `future`."""

    method: Callable[[FrontendEngine], object]
    future: asyncio.Future


Command = AddRequest | AbortRequest | EngineCall


@dataclass
class _Stream:
    request_id: str  # the user's id, put back on every output
    outputs: asyncio.Queue  # RequestOutput deltas, or the exception that ends the stream


class AsyncLLM(AsyncLLMControlVerbs):
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
        self.engine = FrontendEngine.build(
            model, multiprocess=multiprocess, core_address=core_address, engine_args=engine_args
        )
        self.config, self.tokenizer = self.engine.config, self.engine.tokenizer
        self.templates = self.engine.templates  # the chat templates' sandbox (the server renders there)
        self.facts: HandshakeReply = self.engine.facts  # the limits requests are checked against
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._streams: dict[str, _Stream] = {}  # submission key -> stream
        self._key_of: dict[str, str] = {}  # user request id -> key of its submission in flight
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
        return self.engine.token_table

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults, as `LLM.get_default_sampling_params`; used when
        `generate` is given no SamplingParams."""
        return self.engine.get_default_sampling_params()

    @property
    def is_dead(self) -> bool:
        """The core died, hung or failed (or the engine was shut down): no request can finish."""
        return self._error is not None

    @property
    def dead_reason(self) -> str | None:
        return None if self._error is None else str(self._error)

    def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """An async iterator of the request's deltas, submitted at its first `__anext__`. Its id is free
        again as soon as the stream ends: finished, failed, `aclose()`d, cancelled, or left by `break`.
        `lora_request`: the adapter it runs with (docs/lora.md)."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        return RequestStream(lambda: self._start(prompt, params, request_id, lora_request), self._release)

    def encode(
        self, prompt: PromptType, pooling_params: PoolingParams | None = None, request_id: str | None = None,
        lora_request: LoRARequest | None = None, pooling_task: str | None = None,
    ) -> RequestStream:
        """A pooling engine's (runner="pooling"): a stream of one PoolingRequestOutput, the prompt's vector
        under `pooling_task` ("embed" or "classify"; the model's own where None)."""
        facts = self.facts.pooling
        if facts is None:
            raise ValueError("encode needs an engine with runner='pooling'; this one generates")
        params = pooling_sampling_params(pooling_params, pooling_task or facts.tasks[0])
        return self.generate(prompt, params, request_id, lora_request)

    async def _start(
        self, prompt: PromptType, params: SamplingParams, request_id: str, lora_request: LoRARequest | None
    ) -> tuple[str, asyncio.Queue]:
        if lora_request is not None:  # a hub id not fetched yet downloads: in a thread, never on the loop
            params = await asyncio.to_thread(with_lora, params, lora_request, self.engine.request_adapter_folder)
        self._raise_if_dead()
        self._loop = asyncio.get_running_loop()
        if request_id in self._key_of:
            raise ValueError(f"request id {request_id!r} is already in flight")
        request = self.engine.prepare(request_id, prompt, params)  # tokenized here, off the engine thread
        key = request.request_id  # its submission id
        stream = _Stream(request_id, asyncio.Queue())
        self._streams[key], self._key_of[request_id] = stream, key
        self._submit(AddRequest(request))
        return key, stream.outputs

    def _release(self, key: str, is_finished: bool) -> None:
        """Synchronous, on the event loop (or in a finalizer): the id is free before the next statement."""
        stream = self._streams.pop(key, None)
        if stream is not None and self._key_of.get(stream.request_id) == key:
            del self._key_of[stream.request_id]
        if not is_finished:
            self._submit(AbortRequest(key))

    async def abort(self, request_id: str) -> None:
        key = self._key_of.get(request_id)
        if key is not None:
            self._submit(AbortRequest(key))

    async def get_engine_stats(self) -> EngineStats:
        """The core's state (engine-wide), taken between two steps after everything sent before."""
        return await self._call(FrontendEngine.get_stats)

    async def _call(self, method: Callable[[FrontendEngine], T]) -> T:
        """`method(engine)` run on the engine thread, between two output pumps."""
        self._raise_if_dead()
        self._loop = asyncio.get_running_loop()
        future = self._loop.create_future()
        self._submit(EngineCall(method, future))
        return await future

    def shutdown(self) -> None:
        if self._is_stopping.is_set():
            return
        self._is_stopping.set()
        os.write(self._wake_write, b"\0")
        self._thread.join(timeout=30)
        self.engine.shutdown()
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

    def _submit(self, command: Command) -> None:
        if self._is_stopping.is_set():
            return
        self._commands.put(command)
        os.write(self._wake_write, b"\0")

    # ---- engine thread -------------------------------------------------------------------------------

    def _engine_thread(self) -> None:
        engine = self.engine
        try:
            while not self._is_stopping.is_set():
                self._run_commands()
                processed = engine.step(
                    _BUSY_WAIT_S if engine.has_unfinished() else _IDLE_WAIT_S, self._wake_read
                )
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
            match command:
                case AddRequest(request):
                    self._add(request)
                case AbortRequest(key):
                    last_output = self.engine.abort(key)
                    if last_output is not None:  # a stream still listening ends with finish_reason "abort"
                        self._deliver_outputs([last_output])
                case EngineCall(method, future):
                    self._run_call(method, future)

    def _add(self, request: PreparedRequest) -> None:
        """One request's failure (a bug) fails that request alone."""
        try:
            core_requests = self.engine.register([request], is_delta=True)
        except Exception as exc:
            error = exc if isinstance(exc, ValueError) else RequestFailedError(repr(exc))
            self._deliver(request.request_id, error)
            return
        self.engine.send(core_requests)  # raises only when the core is dead: that fails every stream

    def _run_call(self, method: Callable[[FrontendEngine], object], future: asyncio.Future) -> None:
        """A dead core fails the caller, then (raised on) every stream; another error the caller alone."""
        try:
            result = method(self.engine)
        except BaseException as exc:
            error = exc
            self._loop.call_soon_threadsafe(lambda: future.done() or future.set_exception(error))
            if isinstance(exc, (EngineDeadError, KeyboardInterrupt, SystemExit)):
                raise
            return
        self._loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

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
