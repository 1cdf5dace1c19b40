"""AsyncLLM: the asyncio face of the engine (frontend process).

The core client and the output processing (detokenizing, logprob dicts, stop strings) live on one
engine thread, so the event loop only hands requests over and receives finished RequestOutput deltas;
a pipe wakes the engine thread when a request or an abort arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator

from frontend.engine_parts import build_engine_parts
from frontend.errors import EngineDeadError
from frontend.input_processor import PromptType
from frontend.outputs import RequestOutput
from protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0


class AsyncLLM:
    """`async for out in engine.generate(prompt, params, request_id)` yields each step's new tokens, text
    and logprobs; leaving the loop early (break, cancel) aborts the request and frees its KV blocks."""

    def __init__(
        self,
        model: str | None = None,
        *,
        multiprocess: bool = True,
        core_address: str | None = None,
        **engine_args,
    ) -> None:
        self._parts = build_engine_parts(model, multiprocess, core_address, engine_args)
        self.config, self.tokenizer = self._parts.config, self._parts.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        self._streams: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._is_stopping = threading.Event()
        self._thread = threading.Thread(target=self._engine_thread, name="coreserve-engine", daemon=True)
        self._thread.start()

    def get_tokenizer(self):
        return self.tokenizer

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        self._loop = asyncio.get_running_loop()
        params = sampling_params or SamplingParams()
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if self._is_stopping.is_set():
            raise EngineDeadError("the engine was shut down")
        text, token_ids = self._parts.inputs.tokenize(prompt)
        self._parts.inputs.validate(token_ids, params)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        is_finished = False
        try:
            self._submit(("add", request_id, text, token_ids, params))
            while not is_finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                is_finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not is_finished:
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

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
            self._deliver(self._error)

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

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
                results, to_abort = processor.process(client.get_outputs(timeout, self._wake_read))
                client.abort(to_abort)
                if results:
                    self._deliver(results)
        except BaseException as exc:  # the core died: every open stream gets the error
            self._error = exc
            self._deliver(exc)
            logger.error("engine thread stopped: %s", exc)

    def _run_commands(self) -> None:
        client, processor = self._parts.client, self._parts.outputs
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, text, token_ids, params = command
                children = processor.add_request(request_id, text, token_ids, params, is_delta=True)
                client.send(
                    [self._parts.inputs.make_request(core_id, token_ids, p) for core_id, p in children]
                )
            elif command[0] == "abort":
                core_ids, last_output = processor.abort(command[1])
                client.abort(core_ids)
                if last_output is not None:  # a stream still listening ends with finish_reason "abort"
                    self._deliver([last_output])

    def _deliver(self, results) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put_results, results)

    def _put_results(self, results) -> None:
        """On the event loop: hand each delta to its stream, or an error to every stream."""
        if isinstance(results, BaseException):
            for stream in self._streams.values():
                stream.put_nowait(results)
            return
        for result in results:
            stream = self._streams.get(result.request_id)
            if stream is not None:
                stream.put_nowait(result)
