"""Token text for the frontend: each id's bytes, computed once per tokenizer, and an incremental
detokenizer on top of them (frontend process).

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2) map each token to exact bytes, so text is the UTF-8
decoding of the concatenated bytes and no tokenizer call is made per token. Every other tokenizer
(SentencePiece with byte fallback: Llama 2, Mistral) is decoded over a short window of the last
tokens, as vLLM and `tokenizers.decoders.DecodeStream` do: O(new tokens) per step, and the text equals
`tokenizer.decode(ids, skip_special_tokens=...)` of the whole sequence. Ids past the tokenizer (a
padded embedding) have no text.
"""

from __future__ import annotations

import codecs
import functools
import re

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback tokens
_SPM_SPACE = "\u2581"


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
    """Per token id: its bytes and its text for logprob entries (`decoded_token`); for byte-level
    tokenizers the bytes are also how text is built."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_tokens = len(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", {})  # reserved specials are not all_special_ids
        self.special_ids = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        byte_level = _byte_level_bytes(tokenizer)
        self.is_byte_level = byte_level is not None
        self.token_bytes = byte_level if byte_level is not None else _piece_bytes(tokenizer)
        # Byte-fallback tokens: a run of them decodes as one unit, so a decode window never splits one.
        self.byte_token_ids = frozenset() if self.is_byte_level else _byte_token_ids(tokenizer)
        if self.token_bytes is not None:
            self.decoded = [b.decode("utf-8", "surrogateescape") for b in self.token_bytes]
        else:
            self.decoded = [tokenizer.decode([i]) for i in range(self.num_tokens)]

    def decode_token(self, token_id: int) -> str:
        if 0 <= token_id < len(self.decoded):
            return self.decoded[token_id]
        return ""  # ids past the tokenizer (a padded embedding) have no text


def _byte_level_bytes(tokenizer) -> list[bytes] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = type(getattr(backend, "decoder", None)).__name__
    if decoder != "ByteLevel" or not _decode_keeps_spaces(tokenizer):
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


def _decode_keeps_spaces(tokenizer) -> bool:
    """False where decode applies `clean_up_tokenization_spaces` (" ," -> ","): text is then not the
    tokens' bytes. transformers 5 ignores the flag for BPE (the Llama 3 tokenizer sets it), so ask."""
    sample = "a , b . c n't"
    return tokenizer.decode(tokenizer.encode(sample, add_special_tokens=False)) == sample


def _piece_bytes(tokenizer) -> list[bytes] | None:
    """SentencePiece with byte fallback: "▁" is a space, `<0xNN>` is the byte NN, added tokens are their
    content. The bytes a token adds in the middle of a text (decode([id]) strips a leading space)."""
    if not _has_byte_fallback(tokenizer):
        return None
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    table = []
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        match = _BYTE_PIECE.match(piece or "")
        if token_id in added or piece is None:
            table.append((added.get(token_id) or "").encode("utf-8"))
        elif match:
            table.append(bytes([int(match.group(1), 16)]))
        else:
            table.append(piece.replace(_SPM_SPACE, " ").encode("utf-8"))
    return table


def _has_byte_fallback(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteFallback" in repr(backend.decoder)


def _byte_token_ids(tokenizer) -> frozenset[int]:
    if not _has_byte_fallback(tokenizer):
        return frozenset()
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return frozenset(i for i, piece in enumerate(pieces) if piece and _BYTE_PIECE.match(piece))


class IncrementalDetokenizer:
    """Text of a growing token sequence; `append` returns only complete characters new since last time."""

    def __init__(
        self, table: TokenTable, skip_special_tokens: bool, spaces_between_special_tokens: bool = True
    ) -> None:
        self.table = table
        self.skip_special = skip_special_tokens
        self.spaces_between_special = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if table.is_byte_level else None
        self._window = _DecodeWindow(self) if self._utf8 is None else None

    def append(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        start, table = len(self.text), self.table
        if self._utf8 is None:
            for token_id in token_ids:
                if token_id < table.num_tokens:  # padded ids have no text
                    self.text += self._window.step(token_id)
            return self.text[start:]
        skip = self.skip_special
        keep = [t for t in token_ids if t < table.num_tokens and not (skip and t in table.special_ids)]
        self.text += self._utf8.decode(b"".join(table.token_bytes[t] for t in keep))
        return self.text[start:]

    def flush(self) -> str:
        """At the end: dangling bytes of an unfinished character become U+FFFD, as the tokenizer does."""
        tail = self._utf8.decode(b"", final=True) if self._utf8 is not None else self._window.flush()
        self.text += tail
        return tail

    def decode(self, token_ids: list[int]) -> str:
        return self.table.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special,
            spaces_between_special_tokens=self.spaces_between_special,
        )


class TokenIdsOnly:
    """IncrementalDetokenizer's interface without the text (`SamplingParams(detokenize=False)`, vLLM's):
    the token ids only, the text always ""."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""

    def append(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        return ""

    def flush(self) -> str:
        return ""


class _DecodeWindow:
    """vLLM's prefix/read offsets over the ids: each step decodes the tokens since the one before the
    last emitted chunk, and emits what they add to the text of that prefix. Text waits while it ends in
    an unfinished character (U+FFFD) or a byte-fallback token (a later byte can change how the run
    decodes), so every window starts where the whole sequence's decode has a settled boundary."""

    def __init__(self, owner: IncrementalDetokenizer) -> None:
        self.owner = owner
        self.ids: list[int] = []  # the ids decode sees (below the tokenizer's size; specials if kept)
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""  # the decode of ids[prefix_offset:read_offset]

    def step(self, token_id: int) -> str:
        table = self.owner.table
        if self.owner.skip_special and token_id in table.special_ids:
            return ""  # decode drops it before decoding: it must not end a byte run here either
        self.ids.append(token_id)
        if token_id in table.byte_token_ids:
            return ""
        text = self.owner.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(self.prefix_text) or text.endswith("\ufffd"):
            return ""
        if not text.startswith(self.prefix_text):  # never seen; resynchronise on the whole text
            return self._resync()
        new_text = text[len(self.prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.prefix_text = self.owner.decode(self.ids[self.prefix_offset :])
        return new_text

    def flush(self) -> str:
        if self.read_offset == len(self.ids):
            return ""
        text = self.owner.decode(self.ids[self.prefix_offset :])
        new_text = text[len(self.prefix_text) :] if text.startswith(self.prefix_text) else self._resync()
        self.prefix_offset = self.read_offset = len(self.ids)
        self.prefix_text = ""
        return new_text

    def _resync(self) -> str:
        """O(length), as a last resort: what the whole sequence's text adds to what was emitted."""
        text = self.owner.decode(self.ids)
        emitted = self.owner.text
        self.prefix_offset = self.read_offset = len(self.ids)
        self.prefix_text = ""
        return text[len(emitted) :] if text.startswith(emitted) else ""
