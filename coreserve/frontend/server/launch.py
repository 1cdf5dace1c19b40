"""Starts one server: an AsyncLLM (spawned core or a daemon) and uvicorn in front of it (frontend
process, entry point). The first SIGTERM or SIGINT drains (deploy/drain.py) before uvicorn stops; the
server then exits 0, having stopped the core it spawned."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from coreserve.frontend.async_llm import AsyncLLM
from coreserve.frontend.server.app import build_app
from coreserve.frontend.server.args import (
    api_key,
    engine_kwargs,
    model_to_serve,
    read_chat_template,
    served_model_name,
)
from coreserve.frontend.server.deploy.drain import ANSWER_GRACE_S, Drain
from coreserve.frontend.server.lora import load_modules, parse_lora_modules
from coreserve.frontend.server.state import ServerState

logger = logging.getLogger(__name__)


def serve(args: argparse.Namespace) -> None:
    chat_template = read_chat_template(args)  # a bad path fails before the engine starts
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser NAME")
    harmony = (args.reasoning_parser == "openai_gptoss", args.tool_call_parser == "openai")
    if any(harmony) and not all(harmony) and None not in (args.reasoning_parser, args.tool_call_parser):
        message = "harmony (gpt-oss) is read whole: --reasoning-parser openai_gptoss goes with --tool-call-parser openai"
        raise SystemExit(message)
    # Outside uvicorn's handlers (while the engine starts; a signal uvicorn re-raises) a SIGTERM unwinds,
    # as a SIGINT does, so that the core being spawned is stopped instead of loading on alone.
    signal.signal(signal.SIGTERM, _exit_now)
    engine = AsyncLLM(model_to_serve(args), core_address=args.core_address, **engine_kwargs(args))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await load_modules(app.state.server, lora_modules)  # before the first request is served
        yield
        # The engine (and the core it spawned) stops at the end of uvicorn's shutdown, after the drain;
        # serve's `finally` is for a start that failed, or a signal uvicorn re-raised.
        engine.shutdown()

    try:
        state = ServerState(
            engine,
            served_model_name(args),
            chat_template,
            api_key(args),
            max_request_bytes=args.max_request_bytes,
            enable_rl_endpoints=args.enable_rl_endpoints,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            max_queued_requests=args.max_queued_requests,
            enable_lora=args.enable_lora,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            drain=Drain(args.shutdown_timeout),
        )
        logger.info("serving %s on http://%s:%d", state.served_model_name, args.host, args.port)
        run_uvicorn(build_app(state, lifespan), args, state.drain, engine.shutdown)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already: the engine's shutdown is bounded
        engine.shutdown()  # uvicorn failed to start, or returned normally: shutting down twice is harmless


def run_uvicorn(app: FastAPI, args: argparse.Namespace, drain: Drain, abort: Callable[[], None]) -> None:
    """Serves `app` until a signal's drain has ended; SystemExit(1) where the address cannot be bound."""
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=ANSWER_GRACE_S,  # after the drain: only a handler stuck past it is left
    )
    server = DrainingServer(config, drain, abort)
    server.run()
    if not server.started:
        raise SystemExit(1)


def _exit_now(sig: int, frame: FrameType | None) -> None:
    logger.warning("%s: exiting now", signal.Signals(sig).name)
    raise SystemExit(0)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but its first SIGTERM or SIGINT drains while it still listens (uvicorn would stop
    listening at once, then re-raise the signal): `drain.run(abort)`, then uvicorn's own shutdown, and
    the process exits 0. A second signal ends the wait at once (what is left is answered with an error,
    then the same exit); a third is uvicorn's own (it cuts streams, a SIGINT stops waiting on
    connections, and the signal is re-raised)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, abort: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain, self.abort = drain, abort
        self.num_signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()  # uvicorn installs the handlers inside serve, after this
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Python runs it on the main thread between two bytecodes: only flags and a thread-safe call."""
        self.num_signals += 1
        if self.num_signals == 1:
            self.drain.begin()  # /ready and new requests are 503 from the next request on
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self.num_signals == 2:
            logger.warning("a second signal: ending the requests in flight now")
            self.drain.hurry()
        else:
            super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run(self.abort)
        finally:
            self.should_exit = True
