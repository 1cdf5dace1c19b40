"""What LLM and AsyncLLM both stand on: config, tokenizer, core client, input and output processing."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.core_client import InprocClient, MPClient
from frontend.engine_args import load_tokenizer, make_config
from frontend.input_processor import InputProcessor
from frontend.output_processor import OutputProcessor
from frontend.token_text import TokenTable
from protocol.config import EngineConfig
from protocol.model_facts import tokenizer_fingerprint


@dataclass
class EngineParts:
    config: EngineConfig
    tokenizer: object
    client: MPClient | InprocClient
    inputs: InputProcessor
    outputs: OutputProcessor


def build_engine_parts(
    model: str | None, multiprocess: bool, core_address: str | None, engine_args: dict
) -> EngineParts:
    config = make_config(model, engine_args)
    tokenizer = load_tokenizer(config.model)
    fingerprint = tokenizer_fingerprint(config.model)
    if multiprocess or core_address:
        client = MPClient(config, fingerprint, core_address)
    else:
        client = InprocClient(config, fingerprint)
    return EngineParts(
        config,
        tokenizer,
        client,
        InputProcessor(tokenizer, client.facts),
        OutputProcessor(TokenTable(tokenizer)),
    )
