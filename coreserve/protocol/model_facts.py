"""Facts both sides read from a model folder without loading it: EOS ids, a tokenizer fingerprint and
generation_config.json's sampling defaults. A GGUF file gives them from its metadata (it has no
generation config: vLLM's defaults apply)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from coreserve.protocol.gguf_header import is_gguf, read_gguf_header

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")


def tokenizer_fingerprint(model_dir: str) -> str:
    """A hash of the tokenizer's vocabulary files: two folders with the same tokenizer agree. A GGUF file's
    is the hash of its `tokenizer.*` metadata, whichever process reads it."""
    if is_gguf(model_dir):
        return read_gguf_header(model_dir).tokenizer_digest
    digest = hashlib.sha256()
    found = False
    for name in _TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.exists():
            digest.update(name.encode() + b"\0" + path.read_bytes())
            found = True
    if not found:
        raise ValueError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {model_dir}")
    return digest.hexdigest()[:32]


def eos_token_ids(model_dir: str) -> list[int]:
    """Every EOS id of config.json and generation_config.json (Llama 3 instruct ends on either of two;
    its config.json names one), in that order, each once. A GGUF file's: `tokenizer.ggml.eos_token_id`."""
    if is_gguf(model_dir):
        eos = read_gguf_header(model_dir).metadata.get("tokenizer.ggml.eos_token_id")
        if eos is not None and not _is_token_id(eos):
            raise ValueError(f"{model_dir}: tokenizer.ggml.eos_token_id={eos!r} is not a token id")
        return [] if eos is None else [eos]
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        eos = _read_json(Path(model_dir) / name).get("eos_token_id")
        listed = [eos] if isinstance(eos, int) else eos or []
        if not isinstance(listed, list) or not all(_is_token_id(t) for t in listed):
            raise ValueError(f"{name} of {model_dir}: eos_token_id={eos!r} must be a token id or a list of them")
        for token_id in listed:
            if token_id not in ids:
                ids.append(token_id)
    return ids


# generation_config.json keys that are sampling defaults, and their SamplingParams names (as vLLM's)
_SAMPLING_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_dir: str) -> dict:
    """generation_config.json's sampling defaults as SamplingParams keyword arguments; {} without one."""
    if is_gguf(model_dir):
        return {}
    config = _read_json(Path(model_dir) / "generation_config.json")
    return {field: config[key] for key, field in _SAMPLING_DEFAULTS.items() if config.get(key) is not None}


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_json(path: Path) -> dict:
    """The file's JSON object, {} without the file; a ValueError naming it when it is not one."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path} is not a JSON file: {type(exc).__name__}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must be a JSON object, not {type(value).__name__}")
    return value
