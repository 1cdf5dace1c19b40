"""Prompt lookup, ngram speculation's proposal: a pure function of a token list, the same in the worker's
proposer and in the core, which proposes for grammar requests itself (their matcher walks the proposal).
Engine-core process; here because it is the one place both the core and the worker may import."""

from __future__ import annotations

import numpy as np


def lookup(token_ids: list[int], shortest: int, longest: int, most: int) -> list[int]:
    """The up to `most` tokens after the latest earlier occurrence of the last n tokens, for the longest
    n in [shortest, longest] that occurs; [] where none does."""
    count = len(token_ids)
    if count <= shortest:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(longest, count - 1), shortest - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: count - 1], n)  # starts 0..count - 1 - n
        matches = np.flatnonzero((windows == tokens[count - n :]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n  # the latest occurrence's next token
            return token_ids[start : start + most]
    return []
