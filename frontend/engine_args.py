"""Engine arguments to EngineConfig, and what the frontend loads from the model folder (frontend process)."""

from __future__ import annotations

import msgspec

from frontend.gguf_tokenizer import gguf_tokenizer_folder
from protocol.builtin_model import builtin_model_path
from protocol.config import EngineConfig
from protocol.gguf_header import is_gguf


def make_config(model: str | None, engine_args: dict) -> EngineConfig:
    """Builds the one frozen config; unknown argument names are a ValueError naming them."""
    known = set(EngineConfig.__struct_fields__) - {"model"}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
    path = builtin_model_path("tiny") if model is None else model
    if model is not None and model.startswith("builtin:"):
        path = builtin_model_path(model.split(":", 1)[1])
    try:  # convert, not the constructor: it checks every field's type (msgspec's __init__ does not)
        return msgspec.convert({"model": path, **engine_args}, EngineConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad engine arguments: {exc}") from exc


def load_tokenizer(model_dir: str):
    """The folder's tokenizer, or a GGUF file's (converted once, then cached: frontend/gguf_tokenizer.py)."""
    from transformers import AutoTokenizer

    if is_gguf(model_dir):
        return AutoTokenizer.from_pretrained(gguf_tokenizer_folder(model_dir))
    return AutoTokenizer.from_pretrained(model_dir)
