"""Token text: decoded tokens equal the tokenizer's, raw bytes stay recoverable, text matches decode."""

from __future__ import annotations

import numpy as np
import pytest

from coreserve.frontend.engine.token_text import IncrementalDetokenizer, TokenTable


@pytest.fixture(scope="module")
def table(tokenizer):
    return TokenTable(tokenizer)


def test_decoded_token_equals_tokenizer_decode_where_valid_utf8(table, tokenizer):
    assert table.is_byte_level
    checked = 0
    for token_id in range(0, len(tokenizer), 7):
        raw = table.token_bytes[token_id]
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert table.decode_token(token_id) == tokenizer.decode([token_id]), token_id
        checked += 1
    assert checked > 6000


def test_incomplete_utf8_tokens_keep_their_bytes_and_stay_distinct(table, tokenizer):
    partial = [i for i, raw in enumerate(table.token_bytes) if raw and not _is_utf8(raw)]
    assert len(partial) > 50
    texts = {}
    for token_id in partial:
        text = table.decode_token(token_id)
        assert text and text != "\ufffd"
        assert text.encode("utf-8", "surrogateescape") == table.token_bytes[token_id]
        texts.setdefault(text, []).append(token_id)
    assert all(len(ids) == 1 for ids in texts.values())
    assert tokenizer.decode([partial[0]]) == "\ufffd"  # what a plain decode would have lost


def test_incremental_text_equals_decode_of_all_tokens(table, tokenizer):
    rng = np.random.default_rng(0)
    for _ in range(20):
        token_ids = rng.integers(0, len(tokenizer), 40).tolist()
        detokenizer = IncrementalDetokenizer(table, skip_special_tokens=True)
        pieces = [detokenizer.append(token_ids[i : i + 3]) for i in range(0, 40, 3)]
        pieces.append(detokenizer.flush())
        assert "".join(pieces) == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_streamed_text_never_splits_a_character(table, tokenizer):
    token_ids = tokenizer("日本語のテキスト").input_ids
    detokenizer = IncrementalDetokenizer(table, skip_special_tokens=True)
    pieces = [detokenizer.append([t]) for t in token_ids]
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) == "日本語のテキスト"


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
