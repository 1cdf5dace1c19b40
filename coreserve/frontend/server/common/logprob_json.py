"""Every logprob JSON shape the server writes, and the JSON response (frontend process, HTTP server).
The routes hand their positions here and write no logprob key themselves (tests/test_server_structure.py).

- OpenAI's legacy completions: `tokens`, `token_logprobs`, `top_logprobs` (one {token text: logprob} per
  position, the sampled token included) and `text_offset` (`LegacyLogprobs`).
- OpenAI's chat: `content` entries {token, logprob, bytes, top_logprobs} (`chat_content`).
- vLLM's `prompt_logprobs`: per prompt position {token id: {logprob, rank, decoded_token}}
  (`vllm_prompt_logprobs`), on completions, chat and /inference/v1/generate.
- vLLM's /inference/v1/generate: `content` entries {token: "token_id:N", logprob, top_logprobs}
  (`token_id_content`).
- SGLang's /generate: `output_token_logprobs` [logprob, token id, null] per token and
  `output_top_logprobs` (`sglang_columns`, `sglang_fields`).
- TRL's /get_sequence_logprobs: the top k's ids and logprobs and the actual token's (`trl_sequence_answer`).
- Hidden states beside them (`add_hidden_states`): a choice's `hidden_states`, its completion's [indices asked,
  positions, hidden] float32 array as base64 of the little-endian bytes in C order, with its shape and first
  position (docs/serving.md, "Hidden states"). Like routed experts, they travel whole in the choice's
  finishing piece (a stream's last chunk of that choice): base64 pieces of arbitrary byte counts would not
  concatenate into the whole answer's.

A token that is not valid UTF-8 on its own (a piece of a multi-byte character) is written
"bytes:\\xe6\\x97" (every byte escaped, OpenAI's form) wherever text is expected; `bytes` stays exact.
-inf (and NaN, which the engine never makes) becomes -9999.0, OpenAI's and vLLM's value: JSON has
neither (SGLang's and TRL's shapes keep the engine's float, which msgspec writes as null, as SGLang's
orjson does). A k of -1 is the whole vocabulary.

`JSONBytesResponse`: every JSON body, encoded by msgspec, faster than the standard library for the
many small floats of logprob responses (made finite by the formatters here before they get there).
"""

from __future__ import annotations

import base64
import codecs
import json
import math

import msgspec
import numpy as np
from starlette.responses import Response

from coreserve.frontend.engine.token_text import TokenTable
from coreserve.frontend.outputs import CompletionOutput, Logprob, PositionLogprobs

NO_LOGPROB = -9999.0


def finite(value: float) -> float:
    return value if math.isfinite(value) else NO_LOGPROB


def token_bytes(decoded: str) -> bytes:
    return decoded.encode("utf-8", "surrogateescape")


def token_text(decoded: str) -> str:
    """The token's text for JSON: itself, or "bytes:\\xNN..." when its bytes are not valid UTF-8 alone."""
    try:
        decoded.encode("utf-8")
    except UnicodeEncodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in token_bytes(decoded))
    return decoded


def top_entries(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The top-k (token id, candidate) in rank order (the sampled token only if it ranks within k)."""
    ranked = [(token_id, lp) for token_id, lp in position.items() if _within(lp, k)]
    return sorted(ranked, key=_rank)


def _within(logprob: Logprob, k: int) -> bool:
    """Whether a candidate ranks within the top k (-1: the whole vocabulary)."""
    return logprob.rank is not None and (k == -1 or logprob.rank <= k)


def _rank(entry: tuple[int, Logprob]) -> int:
    return entry[1].rank


class LegacyLogprobs:
    """One completions choice's `logprobs`, built position by position; `take()` returns what was added
    since the last call, so a stream's chunks concatenate to the whole. Offsets count characters of the
    choice's text, the echoed prompt included, as the UTF-8 decoder produces them."""

    def __init__(self, table: TokenTable, skip_special_tokens: bool, as_token_ids: bool = False) -> None:
        self.table = table
        self.skip_special = skip_special_tokens
        self.as_token_ids = as_token_ids  # vLLM's return_tokens_as_token_ids: "token_id:N" for each token
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._piece = _empty_piece()

    def add(
        self,
        token_ids: list[int],
        positions: list[PositionLogprobs | None],
        k: int,
        is_prompt: bool = False,
        masses: list[float] | None = None,
    ) -> None:
        """`masses`: structured outputs' constraint_masses, one per token: `constraint_mass`, beside
        `token_logprobs` (null for echoed prompt tokens), docs/structured_outputs.md."""
        piece = self._piece
        if masses is not None:
            piece.setdefault("constraint_mass", [None] * len(piece["tokens"])).extend(masses)
        for token_id, position in zip(token_ids, positions):
            piece["text_offset"].append(self.offset)
            self._advance(token_id, is_prompt)
            if position is None:  # the prompt's first token: nothing before it to condition on
                piece["tokens"].append(self._name(token_id, self.table.decode_token(token_id)))
                piece["token_logprobs"].append(None)
                piece["top_logprobs"].append(None)
                continue
            chosen = position[token_id]
            piece["tokens"].append(self._name(token_id, chosen.decoded_token))
            piece["token_logprobs"].append(finite(chosen.logprob))
            piece["top_logprobs"].append(self._top(token_id, position, k))

    def _top(self, token_id: int, position: PositionLogprobs, k: int) -> dict[str, float]:
        """The position's own token first (as vLLM writes it), then the top k by rank."""
        top = {self._name(token_id, position[token_id].decoded_token): finite(position[token_id].logprob)}
        for other_id, lp in top_entries(position, k):
            top.setdefault(self._name(other_id, lp.decoded_token), finite(lp.logprob))
        return top

    def _name(self, token_id: int, decoded: str | None) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else token_text(decoded or "")

    def take(self) -> dict:
        piece, self._piece = self._piece, _empty_piece()
        return piece

    def _advance(self, token_id: int, is_prompt: bool) -> None:
        if not is_prompt and self.skip_special and token_id in self.table.special_ids:
            return
        self.offset += len(self._utf8.decode(token_bytes(self.table.decode_token(token_id))))


def _empty_piece() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def chat_content(
    token_ids: list[int],
    positions: list[PositionLogprobs],
    k: int,
    as_token_ids: bool = False,
    masses: list[float] | None = None,
) -> list[dict]:
    """`choices[i].logprobs.content`: per generated token its text (or "token_id:N"), logprob, exact
    bytes, and the top k; with structured outputs, `constraint_mass` (docs/structured_outputs.md)."""
    content = []
    for index, (token_id, position) in enumerate(zip(token_ids, positions)):
        entry = _chat_entry(token_id, position[token_id], as_token_ids)
        entry["top_logprobs"] = [_chat_entry(i, lp, as_token_ids) for i, lp in top_entries(position, k)]
        if masses is not None:
            entry["constraint_mass"] = masses[index]
        content.append(entry)
    return content


def _chat_entry(token_id: int, logprob: Logprob, as_token_ids: bool) -> dict:
    decoded = logprob.decoded_token or ""
    return {
        "token": f"token_id:{token_id}" if as_token_ids else token_text(decoded),
        "logprob": finite(logprob.logprob),
        "bytes": list(token_bytes(decoded)),
    }


def vllm_prompt_logprobs(
    positions: list[PositionLogprobs | None], k: int, candidates: list[int] | list[list[int]] | None = None
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position {token id: {logprob, rank, decoded_token}}, the prompt
    token first, then the top k, then the position's candidate ids (prompt_logprob_token_ids: a flat list
    for every position, or one row per position 1..P-1) whatever their rank. `decoded_token` is null
    where the request asked for no text (detokenize false), as vLLM's."""
    rows: list[dict | None] = []
    for index, position in enumerate(positions):
        if position is None:
            rows.append(None)
            continue
        kept = _candidates_at(candidates, index)
        rows.append(
            {
                token_id: {
                    "logprob": finite(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": _text_or_none(lp.decoded_token),
                }
                for n, (token_id, lp) in enumerate(position.items())
                if n == 0 or _within(lp, k) or token_id in kept
            }
        )
    return rows


def _candidates_at(candidates: list[int] | list[list[int]] | None, index: int) -> frozenset[int]:
    """The candidate ids of prompt position `index` (>= 1)."""
    if not candidates:
        return frozenset()
    if isinstance(candidates[0], int):
        return frozenset(candidates)
    return frozenset(candidates[0] if len(candidates) == 1 else candidates[index - 1])


def _text_or_none(decoded: str | None) -> str | None:
    return None if decoded is None else token_text(decoded)


def token_id_content(token_ids: list[int], positions: list[PositionLogprobs], k: int | None) -> list[dict]:
    """/inference/v1/generate's `logprobs.content` (vLLM's tokens-out shape): per token "token_id:N", its
    logprob, and the position's first max(k, 1) entries (the sampled token first, then by rank)."""
    content = []
    for token_id, position in zip(token_ids, positions):
        top = [{"token": f"token_id:{t}", "logprob": finite(lp.logprob)} for t, lp in position.items()]
        content.append({
            "token": f"token_id:{token_id}",
            "logprob": finite(position[token_id].logprob),
            "top_logprobs": top if k == -1 else top[: max(k or 0, 1)],
        })
    return content


def sglang_columns(token_ids: list[int], positions: list[PositionLogprobs], with_tops: bool) -> dict:
    """One delta's logprobs for SGLang's answer, as columns that concatenate (common/accumulate.py):
    `values`, each token's logprob; `tops`, each position's entries as [logprob, token id, null] by rank
    (empty unless asked)."""
    values = [position[token_id].logprob for position, token_id in zip(positions, token_ids)]
    if not with_tops:
        return {"values": values, "tops": []}
    tops = [[[lp.logprob, i, None] for i, lp in sorted(p.items(), key=_rank)] for p in positions]
    return {"values": values, "tops": tops}


def sglang_fields(columns: dict | None, output_ids: list[int], k: int) -> tuple[dict, dict]:
    """SGLang's logprob fields from the merged columns: the answer's own (`output_token_logprobs` as plain
    floats, coreserve's first shape) and meta_info's (`output_token_logprobs` as [logprob, token id, null],
    `output_top_logprobs` with k)."""
    columns = columns or {"values": [], "tops": []}
    meta = {"output_token_logprobs": [[lp, t, None] for lp, t in zip(columns["values"], output_ids)]}
    if k:
        meta["output_top_logprobs"] = [top[:k] for top in columns["tops"]]
    return {"output_token_logprobs": columns["values"]}, meta


def trl_sequence_answer(rows: list[PositionLogprobs | None], sequence: list[int], start: int, k: int) -> dict:
    """TRL's four lists for one sequence: per scored position the top k by rank (ids and logprobs), and
    the actual token's logprob, exact whether or not it is in the top k."""
    logprobs, token_ids, actual_logprobs, actual_ids = [], [], [], []
    for position in range(start, len(sequence)):
        row = rows[position]
        assert row is not None  # position >= 1 always has a row
        top = sorted((lp.rank, token_id, lp.logprob) for token_id, lp in row.items())[:k]
        token_ids.append([token_id for _, token_id, _ in top])
        logprobs.append([value for _, _, value in top])
        actual_logprobs.append([row[sequence[position]].logprob])
        actual_ids.append([sequence[position]])
    return {
        "logprobs": logprobs,
        "logprob_token_ids": token_ids,
        "actual_logprobs": actual_logprobs,
        "actual_token_ids": actual_ids,
    }


def to_json(content: object) -> bytes:
    """UTF-8 JSON; a string that is not valid Unicode (which no formatter should let through) is written
    with \\u escapes rather than failing the response."""
    try:
        return msgspec.json.encode(content)
    except UnicodeEncodeError:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class JSONBytesResponse(Response):
    media_type = "application/json"

    def render(self, content: object) -> bytes:
        return to_json(content)


def add_hidden_states(piece: dict, completion: CompletionOutput, which: str, num_prompt_tokens: int) -> None:
    """The finished completion's hidden states into its JSON piece; `which`: hidden_states_positions."""
    if completion.hidden_states is not None:
        piece["hidden_states"] = hidden_states_json(completion.hidden_states, which, num_prompt_tokens)


def hidden_states_json(states: np.ndarray, which: str, num_prompt_tokens: int) -> dict:
    """{shape, first_position, dtype, data}: row r of each index is position first_position + r (the
    prompt's first, or with "output" the last prompt token's, whose logits gave the first output token)."""
    data = np.ascontiguousarray(states, dtype="<f4").tobytes()
    return {
        "shape": list(states.shape),
        "first_position": num_prompt_tokens - 1 if which == "output" else 0,
        "dtype": "<f4",
        "data": base64.b64encode(data).decode("ascii"),
    }
