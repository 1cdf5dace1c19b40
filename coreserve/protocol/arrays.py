"""Compact logprob arrays for the wire: raw little-endian buffers plus a shape, no Python object per value.

The struct's type fixes each buffer's dtype (documented per field), so a row costs only its bytes.
The buffer fields are typed `memoryview` so that decoding hands out views of the received frame
(zero-copy); in the core they hold `bytes`, which encode the same.
"""

from __future__ import annotations

import msgspec
import numpy as np


class LogprobsArrays(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of `num_rows` positions, `num_cols` = k + 1 + num_candidates columns each: column 0 the
    chosen token, then the top-k, then the caller's candidate ids (prompt_logprob_token_ids) in their
    order. The candidate fields trail with defaults, so a peer without them reads the rest."""

    num_rows: int
    num_cols: int
    token_ids: memoryview  # [num_rows, num_cols] int32 little-endian, column 0 = sampled/prompt token
    logprobs: memoryview  # [num_rows, num_cols] float32 little-endian
    ranks: memoryview  # [num_rows] int32 little-endian, 1-based rank of column 0 in the vocabulary
    num_candidates: int = 0  # the last columns of token_ids / logprobs
    candidate_ranks: memoryview = b""  # [num_rows, num_candidates] int32 little-endian, 1-based ranks

    @classmethod
    def from_numpy(
        cls,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        ranks: np.ndarray,
        candidate_ranks: np.ndarray | None = None,
    ) -> LogprobsArrays:
        num_rows, num_cols = token_ids.shape
        return cls(
            num_rows,
            num_cols,
            np.ascontiguousarray(token_ids, dtype="<i4").tobytes(),
            np.ascontiguousarray(logprobs, dtype="<f4").tobytes(),
            np.ascontiguousarray(ranks, dtype="<i4").tobytes(),
            0 if candidate_ranks is None else candidate_ranks.shape[1],
            b"" if candidate_ranks is None else np.ascontiguousarray(candidate_ranks, dtype="<i4").tobytes(),
        )

    def token_ids_np(self) -> np.ndarray:  # [num_rows, num_cols] int32
        return np.frombuffer(self.token_ids, dtype="<i4").reshape(self.num_rows, self.num_cols)

    def logprobs_np(self) -> np.ndarray:  # [num_rows, num_cols] float32
        return np.frombuffer(self.logprobs, dtype="<f4").reshape(self.num_rows, self.num_cols)

    def ranks_np(self) -> np.ndarray:  # [num_rows] int32
        return np.frombuffer(self.ranks, dtype="<i4")

    def candidate_ranks_np(self) -> np.ndarray | None:  # [num_rows, num_candidates] int32; None: none asked
        if not self.num_candidates:
            return None
        return np.frombuffer(self.candidate_ranks, dtype="<i4").reshape(self.num_rows, self.num_candidates)

    @property
    def num_bytes(self) -> int:
        return len(self.token_ids) + len(self.logprobs) + len(self.ranks) + len(self.candidate_ranks)


class RoutedExperts(msgspec.Struct, array_like=True, gc=False):
    """A request's routed experts at positions first_position .. first_position + num_rows - 1: for
    each, per MoE layer (in layer order), the top_k expert ids the router chose, most probable first."""

    first_position: int
    num_rows: int
    num_layers: int
    top_k: int
    expert_ids: memoryview  # [num_rows, num_layers, top_k] int16 little-endian

    @classmethod
    def from_numpy(cls, first_position: int, ids: np.ndarray) -> RoutedExperts:
        num_rows, num_layers, top_k = ids.shape
        data = np.ascontiguousarray(ids, dtype="<i2").tobytes()
        return cls(first_position, num_rows, num_layers, top_k, data)

    def to_numpy(self) -> np.ndarray:  # [num_rows, num_layers, top_k] int16
        return np.frombuffer(self.expert_ids, dtype="<i2").reshape(self.num_rows, self.num_layers, self.top_k)


class HiddenStates(msgspec.Struct, array_like=True, gc=False):
    """A request's hidden states at positions first_position .. first_position + num_rows - 1, for each
    of the HF indices it asked (return_hidden_states), in its order."""

    first_position: int
    num_layers: int
    num_rows: int
    hidden_size: int
    values: memoryview  # [num_layers, num_rows, hidden_size] float32 little-endian

    @classmethod
    def from_numpy(cls, first_position: int, states: np.ndarray) -> HiddenStates:
        num_layers, num_rows, hidden_size = states.shape
        data = np.ascontiguousarray(states, dtype="<f4").tobytes()
        return cls(first_position, num_layers, num_rows, hidden_size, data)

    def to_numpy(self) -> np.ndarray:  # [num_layers, num_rows, hidden_size] float32
        shape = (self.num_layers, self.num_rows, self.hidden_size)
        return np.frombuffer(self.values, dtype="<f4").reshape(shape)


class PooledArray(msgspec.Struct, array_like=True, gc=False):
    """A pooling request's result (runner="pooling"): its embedding, or its classifier's label values."""

    size: int
    values: memoryview  # [size] float32 little-endian

    @classmethod
    def from_numpy(cls, values: np.ndarray) -> PooledArray:
        return cls(values.shape[0], np.ascontiguousarray(values, dtype="<f4").tobytes())

    def to_numpy(self) -> np.ndarray:  # [size] float32
        return np.frombuffer(self.values, dtype="<f4", count=self.size)


class SamplingMaskArrays(msgspec.Struct, array_like=True, gc=False):
    """Generated tokens' supports in CSR form: token i's ids are token_ids[offsets[i]:offsets[i + 1]],
    ascending."""

    token_ids: memoryview  # [total] int32 little-endian
    offsets: memoryview  # [num_tokens + 1] int64 little-endian

    @classmethod
    def from_rows(cls, rows: list[np.ndarray]) -> SamplingMaskArrays:
        offsets = np.zeros(len(rows) + 1, dtype="<i8")
        offsets[1:] = np.cumsum([len(r) for r in rows])
        ids = np.concatenate(rows).astype("<i4") if rows else np.zeros(0, dtype="<i4")
        return cls(ids.tobytes(), offsets.tobytes())

    def rows(self) -> list[np.ndarray]:
        ids, offsets = np.frombuffer(self.token_ids, dtype="<i4"), np.frombuffer(self.offsets, dtype="<i8")
        return [ids[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]

