"""Runs the engine core alone: `python -m engine_core --model DIR --address ADDR`.

The frontend also starts it this way (with --config-json) when it spawns its own core.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import msgspec

from protocol.addresses import is_loopback
from protocol.config import EngineConfig


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine_core", description=__doc__)
    parser.add_argument("--model", help="a Hugging Face model folder")
    parser.add_argument(
        "--address", required=True, help="ipc://PATH or tcp://127.0.0.1:PORT (uses PORT and PORT+1)"
    )
    parser.add_argument("--config-json", help="a whole EngineConfig as JSON (used by a spawning frontend)")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is no longer the parent")
    parser.add_argument("--allow-remote", action="store_true", help="allow binding beyond loopback")
    parser.add_argument("--log-level", default="INFO")
    for field in EngineConfig.__struct_fields__:
        if field != "model":
            parser.add_argument("--" + field.replace("_", "-"), dest=field, default=None)
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> EngineConfig:
    if args.config_json:
        return msgspec.json.decode(args.config_json, type=EngineConfig)
    if not args.model:
        raise SystemExit("--model is required")
    values = {
        f: getattr(args, f)
        for f in EngineConfig.__struct_fields__
        if f != "model" and getattr(args, f) is not None
    }
    return msgspec.convert({"model": args.model, **values}, EngineConfig, strict=False)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s core %(levelname)s %(name)s: %(message)s")
    if not is_loopback(args.address) and not args.allow_remote:
        raise SystemExit(f"refusing to listen on {args.address}: not loopback (pass --allow-remote)")
    config = build_config(args)
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)
    from engine_core.core import EngineCore
    from engine_core.server import CoreServer

    server = CoreServer(EngineCore(config), args.address, parent_pid=args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    logging.getLogger(__name__).info("engine core serving %s on %s", config.model, args.address)
    server.serve_forever()


if __name__ == "__main__":
    main()
