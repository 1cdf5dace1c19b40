"""The one accumulator of a non-streaming answer (frontend process, HTTP server): every route writes
each delta of a completion as a JSON piece, the same piece it streams, and a whole answer is its
pieces merged here, so a stream's chunks always concatenate to the whole answer.

The merge: text concatenates; lists (token ids, sampling masks) and the lists inside a dict (the
logprobs' columns) extend; `finish_reason` and `stop_reason` are set by the piece that finishes;
`routed_experts` and `hidden_states` (the finished completion's, every position's) replace; any other key keeps its
first value (`index`, the prompt's parts, which only a first piece carries).
"""

from __future__ import annotations

_REPLACED = frozenset(("routed_experts", "hidden_states"))


def merge_piece(into: dict, piece: dict) -> None:
    """Adds one delta's JSON piece to the answer so far, `into` (empty before the first piece)."""
    for key, value in piece.items():
        if key in ("finish_reason", "stop_reason"):
            if key not in into or piece["finish_reason"] is not None:
                into[key] = value
        elif key in _REPLACED or into.get(key) is None:
            into[key] = _copied(value)
        elif isinstance(value, str):
            into[key] += value
        elif isinstance(value, list):
            into[key].extend(value)
        elif isinstance(value, dict):
            for column, values in value.items():
                into[key].setdefault(column, []).extend(values)


def _copied(value: object) -> object:
    """A piece's lists are copied before they grow, so a streamed piece is never changed."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return {key: list(v) if isinstance(v, list) else v for key, v in value.items()}
    return value


class WholeChoices:
    """Each choice's merged pieces, by the piece's `index`."""

    def __init__(self) -> None:
        self.by_index: dict[int, dict] = {}

    def add(self, piece: dict) -> None:
        merge_piece(self.by_index.setdefault(piece["index"], {}), piece)

    def get(self, index: int) -> dict | None:
        return self.by_index.get(index)
