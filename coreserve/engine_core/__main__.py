"""Runs the engine core alone: `python -m coreserve.engine_core --model DIR --address ADDR`.

The frontend also starts it this way (with --config-json) when it spawns its own core. Every mistake on
the command line is one line on stderr and exit code 2; a core that fails later exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

import msgspec

from coreserve.protocol.addresses import is_loopback, split_address
from coreserve.protocol.config import (
    ENGINE_ARG_HELP,
    EngineConfig,
    parse_kv_events_config,
    parse_speculative_config,
)
from coreserve.protocol.curve_keys import KeyPair, load_allowed_keys, load_key_pair, make_key_pair
from coreserve.protocol.hub_ids import local_model_path


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coreserve.engine_core", description=__doc__)
    parser.add_argument(
        "--model",
        help="a Hugging Face model folder or .gguf file; builtin:tiny / builtin:small / builtin:smollm2; or a "
        "hub id, ORG/NAME (:QUANT or /FILE.gguf for a GGUF file), fetched into the Hugging Face cache",
    )
    parser.add_argument(
        "--address",
        required=True,
        help="ipc://PATH (the folder is created) or tcp://HOST:PORT (uses PORT and PORT+1; "
        "IPv6 as tcp://[::1]:PORT)",
    )
    parser.add_argument("--config-json", help="a whole EngineConfig as JSON (used by a spawning frontend)")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is no longer the parent")
    parser.add_argument(
        "--error-file",
        metavar="FILE",
        help="if the core stops on an error, write it to FILE in one line (used by a spawning frontend, "
        "whose exception then carries the core's own reason)",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a TCP address beyond loopback; needs --curve-secret-key and --authorized-clients",
    )
    parser.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="the daemon's CURVE key pair (NAME.key_secret from `keygen`, mode 0600): encrypt and "
        "authenticate every connection",
    )
    parser.add_argument(
        "--authorized-clients",
        metavar="DIR",
        help="a folder of the public keys (NAME.key) of the clients allowed to connect",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    for field in EngineConfig.__struct_fields__:
        if field != "model":
            flag = "--" + field.replace("_", "-")
            many = {"nargs": "+", "metavar": "DIR"} if field == "lora_allowed_roots" else {}  # a tuple field
            parser.add_argument(flag, dest=field, default=None, help=ENGINE_ARG_HELP.get(field, ""), **many)
    return parser


def build_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """The config from the flags; a value of the wrong type or range exits with one line naming it."""
    try:
        if args.config_json:
            return msgspec.json.decode(args.config_json, type=EngineConfig)
        if not args.model:
            parser.error("--model is required")
        values = {
            f: getattr(args, f)
            for f in EngineConfig.__struct_fields__
            if f != "model" and getattr(args, f) is not None
        }
        if "speculative_config" in values:  # JSON on the command line, vLLM's names
            values["speculative_config"] = parse_speculative_config(values["speculative_config"])
        if "kv_events_config" in values:
            values["kv_events_config"] = parse_kv_events_config(values["kv_events_config"])
        # builtin:NAME made on first use, a hub id fetched (by this daemon, for its own model), as the Python API
        model = local_model_path(args.model, args.revision)
        return msgspec.convert({"model": model, **values}, EngineConfig, strict=False)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        parser.error(_flag_error(str(exc)))


def _flag_error(message: str) -> str:
    """msgspec names a field as `$.max_model_len`; the user typed --max-model-len."""
    if "$." in message:
        name = message.rsplit("$.", 1)[1].split()[0].strip("`'")
        return f"--{name.replace('_', '-')}: {message.rsplit(' - at ', 1)[0]}"
    return message


def check_address(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        split_address(args.address)
    except ValueError as exc:
        parser.error(str(exc))
    has_curve = bool(args.curve_secret_key and args.authorized_clients)
    if bool(args.curve_secret_key) != bool(args.authorized_clients):
        parser.error("--curve-secret-key and --authorized-clients go together")
    if not is_loopback(args.address) and not (args.allow_remote and has_curve):
        parser.error(
            f"refusing to listen on {args.address}: not loopback; a remote daemon needs --allow-remote "
            "with CURVE (--curve-secret-key FILE --authorized-clients DIR; make keys with "
            "`python -m coreserve.engine_core keygen DIR`)"
        )


def load_curve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[KeyPair, str] | None:
    if not args.curve_secret_key:
        return None
    try:
        keys = load_key_pair(args.curve_secret_key)
        load_allowed_keys(args.authorized_clients)  # checked now, loaded again by the server
    except ValueError as exc:
        parser.error(str(exc))
    return keys, args.authorized_clients


def keygen(argv: list[str]) -> None:
    """`python -m coreserve.engine_core keygen DIR [--name NAME]`: a CURVE key pair for a daemon or a client."""
    parser = argparse.ArgumentParser(prog="python -m coreserve.engine_core keygen", description=keygen.__doc__)
    parser.add_argument("folder", help="where to write NAME.key (public) and NAME.key_secret (0600)")
    parser.add_argument("--name", default="server", help="the files' name (default: server)")
    args = parser.parse_args(argv)
    public, secret = make_key_pair(args.folder, args.name)
    print(f"public key: {public}\nkey pair:   {secret}")


def main(argv: list[str] | None = None) -> None:
    started, clock = time.time(), time.perf_counter()  # wall clock: a spawning frontend compares it
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        return keygen(argv[1:])
    parser = make_parser()
    args = parser.parse_args(argv)
    check_address(parser, args)
    curve = load_curve(parser, args)
    config = build_config(parser, args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s core %(levelname)s %(name)s: %(message)s")
    begun = time.perf_counter()
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)
    from coreserve.engine_core.core import EngineCore
    from coreserve.engine_core.server import CoreServer, ProgressClock

    imported = time.perf_counter()
    progress = ProgressClock()
    core = EngineCore(config, on_progress=progress.mark, owns_process=True)
    built = time.perf_counter()
    # The handlers come before the sockets are bound: a SIGTERM that arrives once the socket files exist
    # (a supervisor that saw them) stops the server cleanly instead of killing the process.
    stop_asked = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_asked.set())
    signal.signal(signal.SIGINT, lambda *_: stop_asked.set())
    try:
        try:
            server = CoreServer(core, args.address, parent_pid=args.parent_pid, curve=curve, progress=progress)
        except ValueError as exc:  # the address is taken, or cannot be listened on
            parser.exit(2, f"{parser.prog}: error: {exc}\n")
        signal.signal(signal.SIGTERM, lambda *_: server.stop())
        signal.signal(signal.SIGINT, lambda *_: server.stop())
        if stop_asked.is_set():
            server.stop()  # serve_forever then returns at once, closing the sockets and their files
        logging.getLogger(__name__).info("engine core serving %s on %s", config.model, args.address)
        logging.getLogger(__name__).info(
            "startup: process at %.3f (unix), arguments %.3f s, imports %.3f s, engine %.3f s, sockets %.3f s",
            started, begun - clock, imported - begun,
            built - imported, time.perf_counter() - built,
        )
        server.serve_forever()
    finally:
        core.close()


def run(argv: list[str]) -> None:
    """main(), and an error that stops it written in one line to the --error-file, if one is given
    (the traceback still goes to stderr)."""
    try:
        main(argv)
    except Exception as exc:
        path = argv[argv.index("--error-file") + 1] if "--error-file" in argv[:-1] else None
        if path is not None:
            with open(path, "w") as f:
                f.write(" ".join(f"{type(exc).__name__}: {exc}".split())[:2000])
        raise


if __name__ == "__main__":
    run(sys.argv[1:])
