"""A GGUF file's `tokenizer.*` metadata checked before transformers converts it (frontend process): the
converter trusts it, and a vocabulary of empty or repeated tokens, a list of the wrong length or a
special token id past the vocabulary ends there in an IndexError or a TypeError, or a tokenizer that
maps ids to the wrong text. Each refusal is a ValueError naming the key.
"""

from __future__ import annotations

import numpy as np

from coreserve.protocol.gguf_header import GGUFHeader

MAX_VOCAB = 1 << 22
_PER_TOKEN = ("tokenizer.ggml.scores", "tokenizer.ggml.token_type")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "seperator_token_id",
              "separator_token_id", "cls_token_id", "mask_token_id", "eot_token_id")


def check_gguf_vocabulary(header: GGUFHeader) -> None:
    meta, where = header.metadata, header.path
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{where}: tokenizer.ggml.tokens must be a non-empty array of strings")
    if len(tokens) > MAX_VOCAB:
        raise ValueError(f"{where}: tokenizer.ggml.tokens holds {len(tokens)} tokens, over {MAX_VOCAB}")
    if "" in tokens:
        raise ValueError(f"{where}: tokenizer.ggml.tokens holds an empty token (id {tokens.index('')})")
    if len(set(tokens)) != len(tokens):
        seen: set[str] = set()
        repeated = next(i for i, t in enumerate(tokens) if t in seen or seen.add(t))
        raise ValueError(f"{where}: tokenizer.ggml.tokens holds {tokens[repeated]!r} twice (id {repeated})")
    for key in _PER_TOKEN:
        values = meta.get(key)
        if values is not None and (not hasattr(values, "__len__") or len(values) != len(tokens)):
            raise ValueError(f"{where}: {key} must hold one value per token ({len(tokens)})")
        if key.endswith("scores") and values is not None and not _all_finite(values):
            raise ValueError(f"{where}: {key} holds NaN or infinite scores")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
        raise ValueError(f"{where}: tokenizer.ggml.merges must be an array of strings")
    for name in _TOKEN_IDS:
        value = meta.get(f"tokenizer.ggml.{name}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens)):
            raise ValueError(f"{where}: tokenizer.ggml.{name}={value!r} is not a token id (0..{len(tokens) - 1})")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{where}: tokenizer.chat_template must be a string")


def _all_finite(values) -> bool:
    try:
        return bool(np.isfinite(np.asarray(values, dtype=np.float64)).all())
    except (TypeError, ValueError):
        return False
