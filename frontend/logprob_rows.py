"""Turns the core's compact logprob arrays into vLLM's `dict[int, Logprob]` per position (frontend)."""

from __future__ import annotations

from frontend.outputs import Logprob, PositionLogprobs
from frontend.token_text import TokenTable
from protocol.arrays import LogprobsArrays


def to_position_dicts(arrays: LogprobsArrays, table: TokenTable) -> list[PositionLogprobs]:
    """Column 0 (the sampled or prompt token) comes first with its true rank; top-k entries follow with
    ranks 1..k. A token that is both keeps its one entry."""
    token_rows = arrays.token_ids_np().tolist()
    value_rows = arrays.logprobs_np().tolist()
    ranks = arrays.ranks_np().tolist()
    decoded = table.decoded
    num_decoded = len(decoded)
    positions = []
    for token_ids, values, rank in zip(token_rows, value_rows, ranks):
        chosen = token_ids[0]
        entry = {chosen: Logprob(values[0], rank, decoded[chosen] if chosen < num_decoded else "")}
        for top_rank, (token_id, value) in enumerate(zip(token_ids[1:], values[1:]), start=1):
            if token_id not in entry:
                entry[token_id] = Logprob(
                    value, top_rank, decoded[token_id] if token_id < num_decoded else ""
                )
        positions.append(entry)
    return positions


def add_chosen(total: float, arrays: LogprobsArrays, num_rows: int) -> float:
    """`total` plus the chosen tokens' logprobs of the first `num_rows` rows, added one at a time in
    float64: the same bits whether the tokens came one per output or N per multi-step window."""
    if arrays.num_rows:
        for value in arrays.logprobs_np()[:num_rows, 0].tolist():
            total += value
    return total
