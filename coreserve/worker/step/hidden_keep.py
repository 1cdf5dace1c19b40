"""Which hidden states a step keeps for the requests that ask (return_hidden_states), and each one's rows
of them after the forward (engine-core process).

Before the forward, `hidden_keep` picks the rows of the step's tokens at the positions each asking
request wants (its `hidden_states_positions`) and the union of the HF indices they ask: the model keeps
those layers' outputs at those rows as it runs (`DecoderModel.forward`'s `keep`), and nothing more. The
final norm's output (HF's last index) is the forward's own result, whichever path computed it. After the
forward, `hidden_parts` cuts each request its rows, its indices in its order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from coreserve.protocol.request_rules import resolved_hidden_indices
from coreserve.worker.step.input_batch import RequestState


@dataclass
class HiddenKeep:
    num_layers: int  # L: HF's index of the final norm's output
    layers: tuple[int, ...]  # the indices below L the model keeps (0: the embedding output, i: layer i's)
    rows: torch.Tensor  # [K] int64 rows of the step's tokens whose states are kept
    # req_id -> (the position of its first kept row, that row's place in `rows`, its number of rows)
    spans: dict[str, tuple[int, int, int]]
    indices: dict[str, list[int]]  # req_id -> its indices (0..L), in the order it asked them


def hidden_keep(
    states: Sequence[RequestState], num_tokens: Sequence[int], num_layers: int, device: torch.device
) -> HiddenKeep | None:
    """The step's `states` in batch order, `num_tokens` rows each, their num_computed_tokens still the
    first position; None where no request wants a row of this step."""
    rows: list[int] = []
    spans: dict[str, tuple[int, int, int]] = {}
    indices: dict[str, list[int]] = {}
    row = 0
    for state, num in zip(states, num_tokens):
        asked, start = state.params.hidden_indices, state.num_computed_tokens
        first, end = _wanted_positions(state, start, start + num) if asked is not None else (0, 0)
        if first < end:
            spans[state.req_id] = (first, len(rows), end - first)
            rows.extend(range(row + first - start, row + end - start))
            indices[state.req_id] = resolved_hidden_indices(asked, num_layers)
        row += num
    if not spans:
        return None
    layers = sorted({i for asked in indices.values() for i in asked if i < num_layers})
    return HiddenKeep(num_layers, tuple(layers), torch.tensor(rows, dtype=torch.int64, device=device), spans, indices)


def _wanted_positions(state: RequestState, start: int, end: int) -> tuple[int, int]:
    """The positions of start..end - 1 the request wants: a prompt's (0..P - 1), those that sample an
    output token (P - 1 onwards), or all."""
    which, num_prompt = state.params.hidden_states_positions, state.num_prompt_tokens
    lowest = num_prompt - 1 if which == "output" else 0
    highest = num_prompt if which == "prompt" else end
    return max(start, lowest), min(end, highest)


def hidden_parts(
    keep: HiddenKeep, kept: dict[int, torch.Tensor], final: torch.Tensor
) -> dict[str, list[tuple[int, np.ndarray]]]:
    """req_id -> [(first position, [its indices, rows, hidden] float32)]: `kept` the model's layers at
    keep.rows (index -> [K, hidden]), `final` the forward's final-normed hidden states [T, hidden]."""
    tables = {i: kept[i] for i in keep.layers}
    tables[keep.num_layers] = final.index_select(0, keep.rows)
    parts = {}
    for req_id, (first, offset, count) in keep.spans.items():
        rows = torch.stack([tables[i][offset : offset + count] for i in keep.indices[req_id]])
        parts[req_id] = [(first, rows.float().cpu().numpy())]
    return parts
