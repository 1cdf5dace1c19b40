"""Prompt logprob rows kept beside the prefix cache's blocks (engine-core process), so that a warm
request asking for prompt logprobs reads its cached prefix and still returns every position's row.

The row of prompt position p (the logprob of token p + 1 after tokens 0..p, with the top-k) is made by
the forward at p. A cached block of positions [s, s + B) keeps, per flavour (k and temperature):
- its body: the rows of positions s..s + B - 2, whose targets lie in the block, so its key (its tokens
  and the chain before them) fixes them;
- its edges: the row of its last position for each next token seen, since that row's target is the
  next block's first token, which the block's key does not fix.
A request reads a cached block only when the block has its flavour's body and the edge for its own next
token; otherwise its prefix hit stops before that block and it computes from there (and adds the edge
it computes). The rows are the bits a cold run computes (the forward is batch invariant), so a warm
request's rows equal a cold run's. A block's rows go when the block is evicted or the cache is reset.
Memory: at most B - 1 + MAX_EDGES rows of (k + 1) x 8 + 4 bytes a block and flavour (k <= MAX_K).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coreserve.protocol.arrays import LogprobsArrays
from coreserve.protocol.sampling_params import SamplingParams

MAX_K = 20  # prompt_logprobs=k up to this are kept (the default max_logprobs); larger k compute always
MAX_EDGES = 16  # next tokens remembered per block and flavour; later ones compute the block again

Flavour = tuple[int, "float | None"]  # (k, prompt_logprobs_temperature)
Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # token_ids [R, k + 1], logprobs [R, k + 1], ranks [R]


def flavour_of(params: SamplingParams) -> Flavour | None:
    """The flavour a request's prompt rows are kept under (candidate columns are not kept); None: such
    rows are not kept (no prompt logprobs, the whole vocabulary or more than MAX_K)."""
    k = params.prompt_logprobs
    if k is None or not 0 <= k <= MAX_K:
        return None
    return k, params.prompt_logprobs_temperature


@dataclass
class _BlockRows:
    body: Rows
    edges: dict[int, Rows] = field(default_factory=dict)  # next token id -> the last position's row


class PromptRows:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._rows: dict[int, dict[Flavour, _BlockRows]] = {}  # indexed block -> its rows per flavour

    @property
    def num_blocks(self) -> int:
        return len(self._rows)

    def drop(self, block: int) -> None:
        self._rows.pop(block, None)

    def clear(self) -> None:
        self._rows.clear()

    def can_read(self, block: int, flavour: Flavour, next_token: int) -> bool:
        kept = self._rows.get(block, {}).get(flavour)
        return kept is not None and next_token in kept.edges

    def take(self, blocks: list[int], token_ids: list[int], flavour: Flavour) -> LogprobsArrays:
        """The rows of positions 0..len(blocks) x B - 1, read from the request's cached blocks."""
        size, parts = self.block_size, []
        for i, block in enumerate(blocks):
            kept = self._rows[block][flavour]
            parts.append(kept.body)
            parts.append(kept.edges[token_ids[(i + 1) * size]])
        return LogprobsArrays.from_numpy(*(np.concatenate(column) for column in zip(*parts)))

    def store(
        self,
        indexed: list[tuple[int, int]],
        parts: list[LogprobsArrays],
        prompt_ids: list[int],
        flavour: Flavour,
    ) -> None:
        """Keeps the rows of newly indexed blocks `(block number in the request, the block that holds
        that content)` that lie in the prompt, from the request's rows so far (`parts`, position 0 on)."""
        size, num_rows = self.block_size, sum(p.num_rows for p in parts)
        for number, block in indexed:
            start, last = number * size, (number + 1) * size - 1  # the block's first and last position
            if last >= len(prompt_ids) or num_rows < last:
                continue  # reaches past the prompt (or its rows are not all here): nothing to keep
            flavours = self._rows.setdefault(block, {})
            kept = flavours.get(flavour)
            if kept is None:
                kept = flavours[flavour] = _BlockRows(_row_range(parts, start, last, flavour[0]))
            next_token = prompt_ids[last + 1] if last + 1 < len(prompt_ids) else None
            if next_token is not None and num_rows > last and len(kept.edges) < MAX_EDGES:
                kept.edges.setdefault(next_token, _row_range(parts, last, last + 1, flavour[0]))


def _row_range(parts: list[LogprobsArrays], start: int, end: int, k: int) -> Rows:
    """Rows start..end - 1 of the parts stacked, their first k + 1 columns (candidate columns dropped),
    copied so that they outlive the parts."""
    pieces: list[Rows] = []
    offset = 0
    for part in parts:
        lo, hi = max(start - offset, 0), min(end - offset, part.num_rows)
        if lo < hi:
            columns = slice(lo, hi), slice(0, k + 1)
            pieces.append((part.token_ids_np()[columns], part.logprobs_np()[columns], part.ranks_np()[lo:hi]))
        offset += part.num_rows
    if not pieces:  # a one-token block has no body
        return np.zeros((0, k + 1), np.int32), np.zeros((0, k + 1), np.float32), np.zeros(0, np.int32)
    return tuple(np.concatenate(column).copy() for column in zip(*pieces))  # type: ignore[return-value]
