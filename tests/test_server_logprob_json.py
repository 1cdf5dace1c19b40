"""The JSON forms of logprobs (coreserve/frontend/server/common/logprob_json.py, the one module that writes them),
without a server: finite values, token text for pieces of characters, top-k order, text offsets over
multi-byte characters, k = -1 as the whole vocabulary, and the RL dialects' shapes (vLLM's tokens-out
content, SGLang's columns, TRL's sequence lists)."""

from __future__ import annotations

import math

from coreserve.frontend.engine.token_text import TokenTable
from coreserve.frontend.outputs import Logprob
from coreserve.frontend.server.common.logprob_json import (
    NO_LOGPROB,
    LegacyLogprobs,
    chat_content,
    finite,
    sglang_columns,
    sglang_fields,
    token_bytes,
    token_id_content,
    token_text,
    top_entries,
    trl_sequence_answer,
    vllm_prompt_logprobs,
)

# a position's entries as the engine gives them: the sampled token first, then the top k by rank
POSITION = {7: Logprob(-5.0, 9, "x"), 1: Logprob(-0.1, 1, "a"), 2: Logprob(-2.0, 2, "b")}


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


def test_k_minus_one_is_every_entry_the_engine_gave():
    assert [token_id for token_id, _ in top_entries(POSITION, -1)] == [1, 2, 7]
    (row,) = vllm_prompt_logprobs([POSITION], -1)
    assert list(row) == [7, 1, 2]
    assert len(token_id_content([7], [POSITION], -1)[0]["top_logprobs"]) == 3


def test_prompt_rows_keep_the_prompt_token_the_top_k_and_candidates_and_null_text_without_detokenize():
    rows = vllm_prompt_logprobs([None, POSITION], 1, candidates=[2])
    assert rows[0] is None and list(rows[1]) == [7, 1, 2]
    assert rows[1][7] == {"logprob": -5.0, "rank": 9, "decoded_token": "x"}
    (undecoded,) = vllm_prompt_logprobs([{3: Logprob(-math.inf, 1, None)}], 0)
    assert undecoded[3] == {"logprob": NO_LOGPROB, "rank": 1, "decoded_token": None}


def test_token_id_content_names_tokens_by_id_and_keeps_the_first_max_k_1_entries():
    (entry,) = token_id_content([7], [POSITION], 0)
    assert entry == {"token": "token_id:7", "logprob": -5.0, "top_logprobs": [{"token": "token_id:7", "logprob": -5.0}]}
    (entry,) = token_id_content([7], [POSITION], 2)
    assert [top["token"] for top in entry["top_logprobs"]] == ["token_id:7", "token_id:1"]


def test_sglang_columns_concatenate_to_its_fields():
    first = sglang_columns([7], [POSITION], with_tops=True)
    assert first == {"values": [-5.0], "tops": [[[-0.1, 1, None], [-2.0, 2, None], [-5.0, 7, None]]]}
    assert sglang_columns([7], [POSITION], with_tops=False)["tops"] == []
    top, meta = sglang_fields(first, [7], k=2)
    assert top == {"output_token_logprobs": [-5.0]}
    assert meta == {"output_token_logprobs": [[-5.0, 7, None]], "output_top_logprobs": [[[-0.1, 1, None], [-2.0, 2, None]]]}
    assert sglang_fields(None, [], k=0) == ({"output_token_logprobs": []}, {"output_token_logprobs": []})


def test_trl_answer_has_the_top_k_and_the_actual_token_whatever_its_rank():
    answer = trl_sequence_answer([None, POSITION], [5, 7], start=1, k=1)
    assert answer == {"logprobs": [[-0.1]], "logprob_token_ids": [[1]], "actual_logprobs": [[-5.0]],
                      "actual_token_ids": [[7]]}
