"""Chat templates rendered where a hostile one can be stopped: worker processes with a capped address
space, a time limit and a cap on the text (frontend process; the workers run
coreserve/frontend/engine/template_worker.py).

A chat template is code from the model file (or the server's --chat-template) and runs on every chat
request. Jinja's sandbox keeps it from Python's internals, but nothing in it bounds time or memory, and a
Python thread cannot be stopped: so each render runs in a worker process that is killed when it passes
its time limit or its request is cancelled, and the next render gets a fresh one. `num_workers` renders
run at once; a request waits for a worker within its own time limit. Every refusal is a ValueError
naming the limit.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

_WORKER_FILE = Path(__file__).with_name("template_worker.py")
_LENGTH = struct.Struct(">I")
_POLL_S = 0.05  # how often a waiting render looks at its request's cancellation
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_CHARS_PER_POSITION = 32  # the text cap's default: this many characters per position of the context
DEFAULT_MEMORY_BYTES = 256 << 20  # what a worker's address space may grow by while it renders
DEFAULT_NUM_WORKERS = 2


class TemplateTooLong(ValueError):
    """The rendered text passed the sandbox's cap; `num_chars` says by how much (a server that knows its
    tokenizer can tell the user the prompt cannot fit the context instead)."""

    def __init__(self, message: str, num_chars: int) -> None:
        super().__init__(message)
        self.num_chars = num_chars


class RenderCancelled(Exception):
    """The request that asked for the render went away; the render was stopped."""


class _Worker:
    """One renderer process, started on first use and again after it was killed."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.process: subprocess.Popen | None = None
        self.is_closed = False  # the sandbox closed: no process starts again

    def render(self, request: bytes, deadline: float, cancelled: threading.Event | None) -> dict:
        if self.process is None or self.process.poll() is not None:
            self.start()
        if self.process is None:
            raise RenderCancelled()  # closed meanwhile
        try:
            self.process.stdin.write(_LENGTH.pack(len(request)) + request)
            self.process.stdin.flush()
            reply = msgspec.json.decode(self._read_frame(deadline, cancelled))
        except BaseException:
            self.restart()  # a render stopped half way (time, cancel, a broken pipe) leaves nothing running
            raise
        if reply.get("kind") == "memory":  # the worker exits after it
            self.restart()
        return reply

    def start(self) -> None:
        if self.is_closed:
            return
        self.process = subprocess.Popen(
            [sys.executable, str(_WORKER_FILE), str(self.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
            start_new_session=True,  # a signal to the server's group (a drain) leaves renders to finish
        )  # it exits when its stdin closes: with this process, however it ends

    def restart(self) -> None:
        """A fresh process, importing while the next render is still on its way."""
        self.kill()
        self.start()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout):
                pipe.close()
            self.process = None

    def _read_frame(self, deadline: float, cancelled: threading.Event | None) -> bytes:
        header = self._read(_LENGTH.size, deadline, cancelled)
        return self._read(_LENGTH.unpack(header)[0], deadline, cancelled)

    def _read(self, size: int, deadline: float, cancelled: threading.Event | None) -> bytes:
        fd, chunks, done = self.process.stdout.fileno(), [], 0
        while done < size:
            if self.is_closed or (cancelled is not None and cancelled.is_set()):
                raise RenderCancelled()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            readable, _, _ = select.select([fd], [], [], min(left, _POLL_S))
            if not readable:
                continue
            chunk = os.read(fd, min(size - done, 1 << 20))
            if not chunk:
                process = self.process
                code = process.wait() if process is not None else "closed"
                raise ChildProcessError(f"the chat template's worker exited (code {code})")
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)


class TemplateSandbox:
    """Renders chat templates in worker processes, under `timeout_s` (waiting for a worker included),
    `max_chars` of text, and `memory_bytes` of growth per worker."""

    def __init__(
        self,
        timeout_s: float,
        max_chars: int,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        num_workers: int = DEFAULT_NUM_WORKERS,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"chat_template_timeout must be positive, got {timeout_s}")
        if max_chars < 1:
            raise ValueError(f"chat_template_max_chars must be at least 1, got {max_chars}")
        self.timeout_s, self.max_chars = float(timeout_s), int(max_chars)
        self._workers = [_Worker(memory_bytes) for _ in range(num_workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        # the async path's waits: their own threads, so a slow render never holds the default pool
        self._threads = ThreadPoolExecutor(num_workers + 2, thread_name_prefix="coreserve-template")

    def render(
        self,
        template: str,
        messages: list[dict],
        tools: list[dict] | None,
        variables: dict,
        add_generation_prompt: bool,
        cancelled: threading.Event | None = None,
        deadline: float | None = None,
    ) -> str:
        """The rendered text; a ValueError naming the limit or the template's own error. `deadline`
        (time.monotonic()): where the request's time limit began earlier (queued for a thread)."""
        request = _encode({
            "template": template, "messages": messages, "tools": tools, "variables": variables,
            "add_generation_prompt": add_generation_prompt, "max_chars": self.max_chars,
        })
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        worker = self._idle_worker(deadline, cancelled)
        try:
            reply = worker.render(request, deadline, cancelled)
        except TimeoutError:
            raise ValueError(self._time_message()) from None
        except (ChildProcessError, OSError) as exc:  # killed by the system, or its pipe broke
            raise ValueError(f"the chat template's render failed: {exc} (its memory limit is "
                             f"{worker.memory_bytes >> 20} MiB)") from None
        finally:
            self._idle.put(worker)
        return self._text(reply, worker)

    def _idle_worker(self, deadline: float, cancelled: threading.Event | None) -> _Worker:
        """A free worker, waited for until the deadline or the request's cancellation."""
        while True:
            if cancelled is not None and cancelled.is_set():
                raise RenderCancelled()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ValueError(self._time_message())
            try:
                return self._idle.get(timeout=min(left, _POLL_S))
            except queue.Empty:
                continue

    async def render_async(self, *args) -> str:
        """`render` off the event loop; cancelling the awaiting task kills the render."""
        cancelled, deadline = threading.Event(), time.monotonic() + self.timeout_s  # a queued wait counts too
        loop = asyncio.get_running_loop()
        call = functools.partial(self.render, *args, cancelled=cancelled, deadline=deadline)
        future = loop.run_in_executor(self._threads, call)
        try:
            return await future
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def start(self) -> None:
        """Starts the workers now (they import for about half a second) rather than on the first render."""
        for worker in self._workers:
            if worker.process is None:
                worker.start()

    def close(self) -> None:
        for worker in self._workers:
            worker.is_closed = True  # a render still reading ends as cancelled, and starts nothing
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _text(self, reply: dict, worker: _Worker) -> str:
        kind = reply.get("kind")
        if kind is None:
            return reply["text"]
        if kind == "length":
            raise TemplateTooLong(f"the chat template's text ({reply['error']}) is longer than the limit of "
                                  f"{self.max_chars} characters (chat_template_max_chars)", reply["num_chars"])
        if kind == "memory":
            raise ValueError(f"the chat template ran past its memory limit of {worker.memory_bytes >> 20} MiB")
        raise ValueError(reply["error"])

    def _time_message(self) -> str:
        return f"the chat template did not finish within its time limit of {self.timeout_s:g} s (chat_template_timeout)"


def _encode(request: dict) -> bytes:
    try:
        return msgspec.json.encode(request)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"messages, tools and chat_template_kwargs must be JSON values: {exc}") from None
