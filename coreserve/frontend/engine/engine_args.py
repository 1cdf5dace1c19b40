"""Engine arguments to EngineConfig, and what the frontend loads from the model folder (frontend process)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from coreserve.frontend.engine.gguf_tokenizer import gguf_tokenizer_folder
from coreserve.protocol.config import EngineConfig, parse_kv_events_config, parse_speculative_config
from coreserve.protocol.gguf_header import is_gguf
from coreserve.protocol.hub_ids import local_model_path


def make_config(model: str | None, engine_args: dict, with_weights: bool = True) -> EngineConfig:
    """Builds the one frozen config; unknown argument names are a ValueError naming them. `model` becomes
    the local path the core loads: a hub id is downloaded here, before any core is spawned
    (coreserve/protocol/hub_ids.py; `with_weights` False: its tokenizer and config alone, for a daemon's)."""
    known = set(EngineConfig.__struct_fields__) - {"model"}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
    path = local_model_path("builtin:tiny" if model is None else model, engine_args.get("revision"), with_weights)
    if engine_args.get("speculative_config") is not None:
        engine_args = {**engine_args, "speculative_config": parse_speculative_config(engine_args["speculative_config"])}
    if engine_args.get("kv_events_config") is not None:
        engine_args = {**engine_args, "kv_events_config": parse_kv_events_config(engine_args["kv_events_config"])}
    try:  # convert, not the constructor: it checks every field's type (msgspec's __init__ does not)
        return msgspec.convert({"model": path, **engine_args}, EngineConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad engine arguments: {exc}") from exc


def load_tokenizer(model_dir: str):
    """The folder's tokenizer, or a GGUF file's (converted once, then cached: coreserve/frontend/engine/gguf_tokenizer.py)."""
    folder = gguf_tokenizer_folder(model_dir) if is_gguf(model_dir) else model_dir
    direct = direct_tokenizer_class(folder)
    try:
        if direct is not None:
            import transformers

            return getattr(transformers, direct).from_pretrained(folder)
        from transformers import AutoTokenizer  # it imports torch (seconds), through the model configs

        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - a tokenizer file is input: whatever it makes transformers raise
        raise ValueError(f"the tokenizer of {model_dir} cannot be loaded: {exc!r}") from exc


# Tokenizer classes that AutoTokenizer itself loads for a model of these types (or for a folder without
# config.json), named as transformers exports them; loaded directly, they need no torch.
_DIRECT_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer"}
_DIRECT_MODEL_TYPES = {"", "llama"}  # AutoTokenizer substitutes another class for some (qwen2 ...)


def direct_tokenizer_class(folder: str) -> str | None:
    """The class named by tokenizer_config.json where AutoTokenizer would pick that same class; else None."""
    tokenizer_config = _read_json(Path(folder) / "tokenizer_config.json")
    name = tokenizer_config.get("tokenizer_class")
    model_type = _read_json(Path(folder) / "config.json").get("model_type", "")
    for key, value in (("tokenizer_config.json: tokenizer_class", name), ("config.json: model_type", model_type)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{key}={str(value)[:100]} is not a name (a string)")
    if name not in _DIRECT_CLASSES or model_type not in _DIRECT_MODEL_TYPES or "auto_map" in tokenizer_config:
        return None
    return name


def _read_json(path: Path) -> dict:
    """The file's JSON object; {} where there is none (the loader names what is wrong with it)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
