"""The JSON forms of logprobs (coreserve/frontend/server/common/logprob_json.py), without a server: finite values, token
text for pieces of characters, top-k order, and text offsets over multi-byte characters."""

from __future__ import annotations

import math

from coreserve.frontend.engine.token_text import TokenTable
from coreserve.frontend.outputs import Logprob
from coreserve.frontend.server.common.logprob_json import (
    NO_LOGPROB,
    LegacyLogprobs,
    chat_content,
    finite,
    token_bytes,
    token_text,
    top_entries,
)


def test_minus_infinity_and_nan_become_minus_9999():
    assert finite(-math.inf) == finite(math.nan) == NO_LOGPROB == -9999.0
    assert finite(-1.5) == -1.5


def test_a_piece_of_a_character_is_written_as_escaped_bytes_and_its_bytes_stay_exact():
    piece = b"\xe6\x97".decode("utf-8", "surrogateescape")
    assert token_text(piece) == "bytes:\\xe6\\x97"
    assert token_bytes(piece) == b"\xe6\x97"
    assert token_text(" caf\u00e9") == " caf\u00e9"


def test_top_entries_are_in_rank_order_and_leave_out_a_sampled_token_below_k():
    position = {7: Logprob(-5.0, 9, "x"), 1: Logprob(-0.1, 1, "a"), 2: Logprob(-2.0, 2, "b")}
    assert [lp.decoded_token for _, lp in top_entries(position, 2)] == ["a", "b"]
    assert [lp.decoded_token for _, lp in top_entries(position, 1)] == ["a"]


def test_chat_content_gives_bytes_and_the_top_k(tokenizer):
    table = TokenTable(tokenizer)
    ids = tokenizer("日本").input_ids
    positions = [{t: Logprob(-1.0, 1, table.decode_token(t))} for t in ids]
    content = chat_content(ids, positions, 1)
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == "日本"
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)


def test_text_offsets_count_characters_not_bytes(tokenizer):
    table = TokenTable(tokenizer)
    text = "é日本 x"
    ids = tokenizer(text).input_ids
    builder = LegacyLogprobs(table, skip_special_tokens=True)
    builder.add(
        ids, [None] + [{t: Logprob(-1.0, 1, table.decode_token(t))} for t in ids[1:]], 0, is_prompt=True
    )
    piece = builder.take()
    assert piece["token_logprobs"][0] is None and piece["top_logprobs"][0] is None
    assert all(0 <= offset <= len(text) for offset in piece["text_offset"])
    assert piece["text_offset"] == sorted(piece["text_offset"]) and builder.offset == len(text)
    assert builder.take()["tokens"] == []  # take() hands each position out once


def test_json_never_fails_on_a_string_that_is_not_unicode():
    import json

    from coreserve.frontend.server.common.logprob_json import to_json

    assert json.loads(to_json({"text": "a\ud800b"})) == {"text": "a\ud800b"}
    assert json.loads(to_json({"logprob": finite(-math.inf)})) == {"logprob": -9999.0}
