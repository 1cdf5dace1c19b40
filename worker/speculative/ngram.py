"""Prompt lookup (`method: "ngram"`): the tokens that followed the latest earlier occurrence of the
context's last n tokens, n from prompt_lookup_max down to prompt_lookup_min (engine-core process)."""

from __future__ import annotations

import numpy as np

from worker.input_batch import RequestState


class NgramProposer:
    def __init__(self, shortest: int, longest: int) -> None:
        self.shortest, self.longest = shortest, longest

    def propose(self, states: list[RequestState], most: list[int]) -> list[list[int]]:
        """Per state, at most `most` tokens (none where the context does not repeat its end)."""
        return [lookup(state.token_ids, self.shortest, self.longest, k) for state, k in zip(states, most)]

    # Nothing per request, no KV cache of its own.
    def forget(self, req_id: str) -> None:
        pass

    def kept(self, req_id: str, num_context: int, num_kept: int) -> None:
        pass

    def host_kv_bytes(self, num_blocks: int) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def release(self) -> None:
        pass


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
