"""Facts both sides read from a model folder without loading it: EOS ids and a tokenizer fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")


def tokenizer_fingerprint(model_dir: str) -> str:
    """A hash of the tokenizer's vocabulary files: two folders with the same tokenizer agree."""
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
    """generation_config.json's eos_token_id when present, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
