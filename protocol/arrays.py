"""Compact logprob arrays for the wire: raw little-endian buffers plus a shape, no Python object per value.

The struct's type fixes each buffer's dtype (documented per field), so a row costs only its bytes.
The buffer fields are typed `memoryview` so that decoding hands out views of the received frame
(zero-copy); in the core they hold `bytes`, which encode the same.
"""

from __future__ import annotations

import msgspec
import numpy as np


class LogprobsArrays(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of `num_rows` positions, `num_cols` = k + 1 candidates each (column 0 = the chosen token)."""

    num_rows: int
    num_cols: int
    token_ids: memoryview  # [num_rows, num_cols] int32 little-endian, column 0 = sampled/prompt token
    logprobs: memoryview  # [num_rows, num_cols] float32 little-endian
    ranks: memoryview  # [num_rows] int32 little-endian, 1-based rank of column 0 in the vocabulary

    @classmethod
    def from_numpy(cls, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> LogprobsArrays:
        num_rows, num_cols = token_ids.shape
        return cls(
            num_rows,
            num_cols,
            np.ascontiguousarray(token_ids, dtype="<i4").tobytes(),
            np.ascontiguousarray(logprobs, dtype="<f4").tobytes(),
            np.ascontiguousarray(ranks, dtype="<i4").tobytes(),
        )

    def token_ids_np(self) -> np.ndarray:  # [num_rows, num_cols] int32
        return np.frombuffer(self.token_ids, dtype="<i4").reshape(self.num_rows, self.num_cols)

    def logprobs_np(self) -> np.ndarray:  # [num_rows, num_cols] float32
        return np.frombuffer(self.logprobs, dtype="<f4").reshape(self.num_rows, self.num_cols)

    def ranks_np(self) -> np.ndarray:  # [num_rows] int32
        return np.frombuffer(self.ranks, dtype="<i4")

    @property
    def num_bytes(self) -> int:
        return len(self.token_ids) + len(self.logprobs) + len(self.ranks)


def concat_logprobs(parts: list[LogprobsArrays]) -> LogprobsArrays:
    """Stacks row blocks of the same width (e.g. prompt logprobs computed chunk by chunk)."""
    if len(parts) == 1:
        return parts[0]
    return LogprobsArrays.from_numpy(
        np.concatenate([p.token_ids_np() for p in parts]),
        np.concatenate([p.logprobs_np() for p in parts]),
        np.concatenate([p.ranks_np() for p in parts]),
    )
