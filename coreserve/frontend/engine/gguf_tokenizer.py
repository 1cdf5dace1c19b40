"""The tokenizer a GGUF file carries, as a Hugging Face tokenizer (frontend process).

transformers converts a GGUF tokenizer (vocabulary, merges, special tokens, chat template) in seconds;
the converted folder is cached under ~/.cache/coreserve/gguf-tokenizers/<digest>, keyed by the digest of
the file's `tokenizer.*` metadata (the handshake's fingerprint, coreserve/protocol/gguf_header.py), so a later load
of any file with that tokenizer reads a plain tokenizer folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from coreserve.frontend.engine.gguf_vocab_checks import check_gguf_vocabulary
from coreserve.protocol.builtin_model import default_cache_dir
from coreserve.protocol.gguf_header import read_gguf_header

CONVERTER_VERSION = 1
# GGUF architectures whose config transformers' GGUF reader does not know, or cannot read (5.25; gpt-oss: its
# YaRN keys): AutoTokenizer reads the config first and fails on them, so their tokenizer is built from the
# `tokenizer.*` keys alone, as AutoTokenizer then builds any other file's
_CONFIGLESS_ARCHS = ("qwen35", "qwen3next", "granitehybrid", "olmo2", "smollm3", "exaone4", "gpt-oss")


def gguf_tokenizer_folder(path: str, cache_dir: Path | None = None) -> str:
    """The converted tokenizer folder of GGUF file `path`, made on first use (safe under races)."""
    digest = read_gguf_header(path).tokenizer_digest
    folder = (cache_dir or default_cache_dir()) / "gguf-tokenizers" / f"{digest}-v{CONVERTER_VERSION}"
    if (folder / "tokenizer_config.json").exists():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        _convert(path, tmp)
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "tokenizer_config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def _convert(path: str, folder: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    header = read_gguf_header(path)
    check_gguf_vocabulary(header)
    source = Path(path).resolve()
    is_configless = header.metadata.get("general.architecture") in _CONFIGLESS_ARCHS
    loader = PreTrainedTokenizerFast if is_configless else AutoTokenizer
    try:
        tokenizer = loader.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as exc:  # noqa: BLE001 - what the checks above cannot foresee (a merge of unknown tokens)
        raise ValueError(f"{path}: the GGUF file's tokenizer cannot be converted: {exc!r}") from exc
    tokenizer.save_pretrained(str(folder))
