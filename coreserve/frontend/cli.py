"""The `coreserve` command (frontend process, entry point): `coreserve serve [MODEL] [flags]`.

Also `python -m coreserve serve`. Subcommands import their machinery only when chosen.
"""

from __future__ import annotations

import argparse
import logging
import sys


def parser() -> argparse.ArgumentParser:
    from coreserve.frontend.server.args import MODEL_FORMS, add_serve_arguments

    top = argparse.ArgumentParser(
        prog="coreserve", description="coreserve: an LLM engine with exact logprobs"
    )
    commands = top.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve MODEL over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /tokenize, /detokenize.",
        epilog=MODEL_FORMS,
    )
    add_serve_arguments(serve)
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        from coreserve.frontend.server.launch import serve

        serve(args)
