"""The real tokenizers the family tests use (Llama 3 byte-level BPE, Llama 2 SentencePiece with byte
fallback), made inside the project: scripts/setup.sh fetches llama.cpp's vocabulary-only GGUF files from
the llama-cpp-python source package on PyPI; this module converts each once, with transformers' GGUF
tokenizer loader and `save_pretrained`, into a cached Hugging Face tokenizer folder.

The conversion gives the vocabulary, merges and pre-tokenizer; the few settings the shipped tokenizers
have and the vocabulary-only files do not carry are set here: Llama 3 adds its BOS and cleans up
spaces, Llama 2 adds its BOS (as the shipped `tokenizer_config.json` files say). gpt-oss's
(`o200k_harmony`) is made by tests/harmony_vocab.py, its source the chat template setup.sh fetches.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from harmony_vocab import TEMPLATE_FILE
from harmony_vocab import convert as convert_harmony

VOCAB_DIR = Path.home() / ".cache" / "coreserve" / "vocab"
CONVERTER_VERSION = 1
_SOURCES = {
    "llama3": "ggml-vocab-llama-bpe.gguf", "llama2": "ggml-vocab-llama-spm.gguf", "o200k_harmony": TEMPLATE_FILE,
}
_CONFIG_EXTRAS = {"llama3": {"clean_up_tokenization_spaces": True}, "llama2": {"add_bos_token": True}}


def real_tokenizer_path(name: str) -> str:
    """The folder of tokenizer `name` ("llama3", "llama2", "o200k_harmony"), converted on first use (safe
    under races)."""
    folder = VOCAB_DIR / f"{name}-v{CONVERTER_VERSION}"
    if (folder / "tokenizer.json").exists():
        return str(folder)
    source = VOCAB_DIR / _SOURCES[name]
    if not source.exists():
        raise FileNotFoundError(f"{source} is missing: run `bash scripts/setup.sh` (make setup) to fetch it")
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=VOCAB_DIR))
    try:
        convert_harmony(source, tmp) if name == "o200k_harmony" else _convert(name, source, tmp)
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "tokenizer.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def _convert(name: str, source: Path, folder: Path) -> None:
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    if name == "llama3":  # the shipped tokenizer.json's post-processor: BOS before each sequence
        bos = tokenizer.bos_token
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)]
        )
    tokenizer.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):  # where this conversion ran, not the tokenizer's
        config.pop(key, None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", **_CONFIG_EXTRAS[name])
    config_path.write_text(json.dumps(config, indent=2))
