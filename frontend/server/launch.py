"""Starts one server: an AsyncLLM (spawned core or a daemon) and uvicorn in front of it (frontend
process, entry point)."""

from __future__ import annotations

import argparse
import contextlib
import logging

import uvicorn

from frontend.async_llm import AsyncLLM
from frontend.server.app import build_app
from frontend.server.args import api_key, engine_kwargs, model_to_serve, read_chat_template, served_model_name
from frontend.server.lora import load_modules, parse_lora_modules
from frontend.server.state import ServerState

logger = logging.getLogger(__name__)


def serve(args: argparse.Namespace) -> None:
    chat_template = read_chat_template(args)  # a bad path fails before the engine starts
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser NAME")
    engine = AsyncLLM(model_to_serve(args), core_address=args.core_address, **engine_kwargs(args))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await load_modules(app.state.server, lora_modules)  # before the first request is served
        yield
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, so code after uvicorn.run may never
        # run: the engine (and the core it spawned) goes here, at the end of the graceful shutdown.
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
        )
        logger.info("serving %s on http://%s:%d", state.served_model_name, args.host, args.port)
        app = build_app(state, lifespan)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()  # uvicorn failed to start, or returned normally: shutting down twice is harmless
