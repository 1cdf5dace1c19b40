"""Token text for the frontend: each id's bytes, computed once per tokenizer, and an incremental
detokenizer on top of them (frontend process).

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2) map each token to exact bytes, so text is the UTF-8
decoding of the concatenated bytes and no tokenizer call is made per token. Other tokenizers fall back
to decoding the whole sequence.
"""

from __future__ import annotations

import codecs
import functools


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible map from bytes to printable characters, inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTable:
    """Per token id: its bytes (byte-level tokenizers) and its decoded text for logprob entries."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.token_bytes = _token_bytes(tokenizer)
        if self.token_bytes is not None:
            self.decoded = [b.decode("utf-8", "surrogateescape") for b in self.token_bytes]
        else:
            self.decoded = [tokenizer.decode([i]) for i in range(len(tokenizer))]

    @property
    def is_byte_level(self) -> bool:
        return self.token_bytes is not None

    def decode_token(self, token_id: int) -> str:
        if 0 <= token_id < len(self.decoded):
            return self.decoded[token_id]
        return ""  # ids past the tokenizer (a padded embedding) have no text


def _token_bytes(tokenizer) -> list[bytes] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = type(getattr(backend, "decoder", None)).__name__
    if decoder != "ByteLevel" or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    alphabet = _byte_level_alphabet()
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    table = []
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token_id in added or piece is None:
            table.append((added.get(token_id) or "").encode("utf-8"))
        elif all(ch in alphabet for ch in piece):
            table.append(bytes(alphabet[ch] for ch in piece))
        else:
            return None  # not a pure byte-level vocabulary after all
    return table


class IncrementalDetokenizer:
    """Text of a growing token sequence; `append` returns only complete characters new since last time."""

    def __init__(self, table: TokenTable, skip_special_tokens: bool) -> None:
        self.table = table
        self.skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if table.is_byte_level else None

    def append(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        if self._utf8 is None:
            new_text = self._full_decode()[len(self.text) :]
        else:
            keep = [t for t in token_ids if not (self.skip_special and t in self.table.special_ids)]
            new_text = self._utf8.decode(b"".join(self.table.token_bytes[t] for t in keep))
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """At the end: dangling bytes of an unfinished character become U+FFFD, as the tokenizer does."""
        if self._utf8 is not None:
            tail = self._utf8.decode(b"", final=True)
        else:
            tail = self.table.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special)[
                len(self.text) :
            ]
        self.text += tail
        return tail

    def _full_decode(self) -> str:
        text = self.table.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special)
        return text[:-1] if text.endswith("\ufffd") else text  # wait for the rest of the character
