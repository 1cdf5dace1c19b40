"""What LLM and AsyncLLM both stand on: config, tokenizer, core client, input and output processing."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from coreserve.frontend.clients.client_protocol import CoreClient
from coreserve.frontend.clients.core_client import ClientCurve, MPClient
from coreserve.frontend.clients.inproc_client import InprocClient
from coreserve.frontend.clients.multi_core_client import MultiCoreClient
from coreserve.frontend.engine.engine_args import load_tokenizer, make_config
from coreserve.frontend.engine.input_processor import InputProcessor
from coreserve.frontend.engine.model_checks import check_model_folder
from coreserve.frontend.engine.output_processor import OutputProcessor
from coreserve.frontend.engine.template_sandbox import (
    DEFAULT_CHARS_PER_POSITION,
    DEFAULT_TIMEOUT_S,
    TemplateSandbox,
)
from coreserve.frontend.engine.token_text import TokenTable
from coreserve.protocol.config import EngineConfig
from coreserve.protocol.curve_keys import load_key_pair, load_public_key
from coreserve.protocol.messages import HandshakeReply
from coreserve.protocol.model_facts import tokenizer_fingerprint

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    config: EngineConfig
    tokenizer: object
    client: CoreClient
    inputs: InputProcessor
    outputs: OutputProcessor
    templates: TemplateSandbox  # where chat templates render (LLM.chat, the server's chat routes)


def build_engine_parts(
    model: str | None, multiprocess: bool, core_address: str | list[str] | None, engine_args: dict
) -> EngineParts:
    """`core_address`: a daemon, or a list of daemons that hold the same model (data parallel).
    `engine_args` may also hold the connection's CURVE keys (with core_address): `curve_server_key`,
    the daemon's public key file, and `curve_client_keys`, this client's key pair file (0600); and the
    chat templates' limits, this process's alone: `chat_template_timeout` (seconds) and
    `chat_template_max_chars` (None: 32 characters a position of max_model_len)."""
    engine_args = dict(engine_args)
    template_limits = (
        engine_args.pop("chat_template_timeout", None), engine_args.pop("chat_template_max_chars", None)
    )
    curve = _client_curve(
        engine_args.pop("curve_server_key", None), engine_args.pop("curve_client_keys", None)
    )
    config = make_config(model, engine_args, with_weights=not core_address)
    check_model_folder(config.model, has_weights_here=not core_address)  # before any process is spawned
    if core_address:
        _check_daemon_args(engine_args)
    elif curve is not None:
        raise ValueError(
            "curve_server_key and curve_client_keys are for attaching to a daemon (core_address)"
        )
    fingerprint = tokenizer_fingerprint(config.model)
    # The tokenizer (its imports are most of this process's start) loads while the core starts.
    pool = ThreadPoolExecutor(1, thread_name_prefix="coreserve-tokenizer")
    begun = time.perf_counter()
    pending = pool.submit(_timed_tokenizer, config.model, begun)
    pool.shutdown(wait=False)  # a core that fails to start is reported without waiting for it
    client = _make_client(config, fingerprint, multiprocess, core_address, curve)
    logger.info("startup: core ready after %.3f s", time.perf_counter() - begun)
    tokenizer = _tokenizer_or_shutdown(pending, client)
    facts = client.facts
    if core_address:
        try:
            facts = _client_limits(facts, engine_args)
        except ValueError:
            client.shutdown()
            raise
    try:
        templates = template_sandbox(*template_limits, facts.max_model_len)
    except ValueError:
        client.shutdown()
        raise
    return EngineParts(
        config=config,
        tokenizer=tokenizer,
        client=client,
        inputs=InputProcessor(tokenizer, facts, core_max_model_len=client.facts.max_model_len),
        outputs=OutputProcessor(TokenTable(tokenizer)),
        templates=templates,
    )


def template_sandbox(timeout_s: float | None, max_chars: int | None, max_model_len: int) -> TemplateSandbox:
    """The chat templates' sandbox, its defaults a few seconds and a multiple of the context in characters."""
    if max_chars is None:
        max_chars = DEFAULT_CHARS_PER_POSITION * max_model_len
    return TemplateSandbox(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s, max_chars)


def _make_client(
    config: EngineConfig, fingerprint: str, multiprocess: bool, core_address, curve: ClientCurve | None
) -> CoreClient:
    if isinstance(core_address, (list, tuple)) and len(core_address) > 1:
        return _attach_all(config, fingerprint, core_address, curve)
    if core_address:
        address = core_address if isinstance(core_address, str) else core_address[0]
        return MPClient(config, fingerprint, address, curve=curve)
    if multiprocess:
        return MPClient(config, fingerprint, None)
    return InprocClient(config, fingerprint)


def _timed_tokenizer(model: str, begun: float) -> object:
    tokenizer = load_tokenizer(model)
    logger.info("startup: tokenizer loaded after %.3f s", time.perf_counter() - begun)
    return tokenizer


def _tokenizer_or_shutdown(pending: Future, client: CoreClient) -> object:
    """The tokenizer; a tokenizer that fails to load stops the core that started meanwhile."""
    try:
        return pending.result()
    except BaseException:
        client.shutdown()
        raise


def _attach_all(config: EngineConfig, fingerprint: str, addresses: list[str], curve) -> MultiCoreClient:
    cores: list[MPClient] = []
    try:
        for address in addresses:
            cores.append(MPClient(config, fingerprint, address, curve=curve))
    except BaseException:
        for core in cores:
            core.shutdown()
        raise
    return MultiCoreClient(cores)


def _client_curve(server_key: str | None, client_keys: str | None) -> ClientCurve | None:
    if server_key is None and client_keys is None:
        return None
    if server_key is None or client_keys is None:
        raise ValueError("curve_server_key and curve_client_keys go together")
    return ClientCurve(load_public_key(server_key), load_key_pair(client_keys))


def _check_daemon_args(engine_args: dict) -> None:
    """A daemon's engine is built already: only limits this client can apply to itself are accepted."""
    fixed = sorted(set(engine_args) - set(_CLIENT_LIMITS) - {"revision"})  # revision: of this client's tokenizer
    if fixed:
        raise ValueError(
            f"engine arguments {fixed} belong to the daemon (pass them to python -m coreserve.engine_core); "
            f"with core_address only {sorted(_CLIENT_LIMITS)} may be given, to apply to this client (and "
            "revision, of a hub id's tokenizer read here)"
        )


def _client_limits(facts: HandshakeReply, engine_args: dict) -> HandshakeReply:
    """The daemon's facts with this client's own, smaller limits; a larger one is a ValueError."""
    limits = {}
    for name in _CLIENT_LIMITS:
        asked, daemon = engine_args.get(name), getattr(facts, name)
        if asked is None:
            continue
        if daemon != -1 and (asked == -1 or asked > daemon):
            raise ValueError(f"{name}={asked} is more than the daemon's {name}={daemon}")
        limits[name] = asked
    return msgspec.structs.replace(facts, **limits)


_CLIENT_LIMITS = ("max_model_len", "max_logprobs")
