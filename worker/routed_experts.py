"""Each token's routed experts, for the requests that asked (return_routed_experts), cut out of a
forward pass's table (engine-core process). The model keeps its last forward's choices
(`LlamaModel.routed_experts`); these helpers give each asking request its rows, by position."""

from __future__ import annotations

from collections.abc import Sequence

from worker.input_batch import RequestState

RoutedParts = dict[str, list]  # req_id -> [(first position, [rows, MoE layers, top_k] int16 numpy)]


def routed_rows(model, states: Sequence[RequestState], num_tokens: Sequence[int]) -> RoutedParts:
    """The forward pass just run: `states` in batch order, `num_tokens` rows each, every state's
    num_computed_tokens still its first position. {} when none asked (nothing is copied)."""
    if not any(s.params.return_routed_experts for s in states):
        return {}
    table = model.routed_experts()
    assert table is not None, "return_routed_experts on a dense model (the request rules refuse it)"
    table, parts, row = table.cpu().numpy(), {}, 0
    for state, num in zip(states, num_tokens):
        if state.params.return_routed_experts:
            parts[state.req_id] = [(state.num_computed_tokens, table[row : row + num].copy())]
        row += num
    return parts


def merge(into: RoutedParts, parts: RoutedParts) -> RoutedParts:
    """A multi-step window's passes, one after the other (a later pass's rows come later)."""
    for req_id, rows in parts.items():
        into.setdefault(req_id, []).extend(rows)
    return into
