"""Turns the core's compact logprob arrays into vLLM's `dict[int, Logprob]` per position (frontend)."""

from __future__ import annotations

from coreserve.frontend.engine.token_text import TokenTable
from coreserve.frontend.outputs import Logprob, PositionLogprobs
from coreserve.protocol.arrays import LogprobsArrays

_NEG_INF = float("-inf")


def to_position_dicts(
    arrays: LogprobsArrays, table: TokenTable, drop_masked: bool = False, detokenize: bool = True
) -> list[PositionLogprobs]:
    """Column 0 (the sampled or prompt token) comes first with its true rank; top-k entries follow with
    ranks 1..k, then the caller's candidate ids (prompt_logprob_token_ids) with their true ranks. A token
    that is more than one of these keeps its one entry (its values are the same bits). `drop_masked`
    (structured outputs): top-k entries at -inf, tokens the grammar forbade, are left out, so fewer
    than k remain where fewer were allowed. `detokenize` False: every decoded_token None (vLLM's)."""
    token_rows = arrays.token_ids_np().tolist()
    value_rows = arrays.logprobs_np().tolist()
    ranks = arrays.ranks_np().tolist()
    candidate_ranks = arrays.candidate_ranks_np()
    candidate_rank_rows = [[]] * arrays.num_rows if candidate_ranks is None else candidate_ranks.tolist()
    num_top = arrays.num_cols - arrays.num_candidates  # column 0 and the top-k
    decoded = table.decoded if detokenize else ()
    num_decoded = len(decoded)
    none = "" if detokenize else None  # padded ids' text; without detokenization, none at all
    positions = []
    for token_ids, values, rank, cand_ranks in zip(token_rows, value_rows, ranks, candidate_rank_rows):
        chosen = token_ids[0]
        entry = {chosen: Logprob(values[0], rank, decoded[chosen] if chosen < num_decoded else none)}
        for top_rank, (token_id, value) in enumerate(zip(token_ids[1:num_top], values[1:num_top]), start=1):
            if token_id not in entry and not (drop_masked and value == _NEG_INF):
                entry[token_id] = Logprob(
                    value, top_rank, decoded[token_id] if token_id < num_decoded else none
                )
        for token_id, value, cand_rank in zip(token_ids[num_top:], values[num_top:], cand_ranks):
            if token_id not in entry:
                entry[token_id] = Logprob(
                    value, cand_rank, decoded[token_id] if token_id < num_decoded else none
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
