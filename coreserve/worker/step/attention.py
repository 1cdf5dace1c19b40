"""Paged attention over a head-major slot cache (engine-core process).

Each layer's cache is `[2, num_kv_heads, num_slots, head_dim]`, slot = block_id * block_size + offset.
Decode rows (one new token with context) are attended together in one call per layer, by the
backend's decode attention (`attend_decode`) over the backend's plan of the rows, made before the
forward: the C kernel on the CPU, reading the blocks in place (coreserve/worker/cpu/attention_plan.py), or
torch's here, one gather of every row's context (`DecodeGather`) and two batched products (no
per-request loop, no per-request kernel launches).
Prefill chunks go one request at a time through SDPA (masked to the sliding window where the model
has one; written out where SDPA lacks the math: soft-caps, gpt-oss's sinks); the KV manager places a request's blocks in
contiguous runs where it can, so a chunk's context is usually a view of the cache, not a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer's attention computes beyond causal softmax attention; the C descriptors read the
    same fields (coreserve/worker/cpu/fused_decode.py's layer_desc, the kernels' arguments)."""

    window: int | None = None  # a token attends to itself and the window - 1 before it; None: all
    scale: float | None = None  # the scores' (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    softcap: float | None = None  # scores become softcap tanh(score / softcap) before the softmax (Gemma 2)
    # False: bidirectional (EmbeddingGemma), every token of a prompt attends to every other, within the
    # window - 1 positions either side where there is a window; a whole prompt in one step, never a decode row
    is_causal: bool = True


@dataclass
class SeqSpan:
    token_start: int  # first row of this request's tokens in the flattened batch
    num_tokens: int  # query tokens this step
    context_len: int  # tokens attended to, this step's included
    runs: list[tuple[int, int]]  # (first slot, number of slots) covering positions 0..context_len - 1


@dataclass
class DecodeRows:
    """Single-token rows with context, attended together in one call per layer (host arrays; each
    backend's plan of them is made before the forward: coreserve/worker/backend.py)."""

    block_size: int
    rows: np.ndarray  # [R] int64, the rows of the flattened batch
    block_tables: np.ndarray  # [R, max_blocks] int32, each request's blocks, zero padded
    context_lens: np.ndarray  # [R] int32, tokens attended to, this step's included

    def next_step(self) -> DecodeRows:
        """The same rows one token further on, as in the next step of a multi-step window (whose
        blocks are reserved up front, so the tables already cover it)."""
        return DecodeRows(self.block_size, self.rows, self.block_tables, self.context_lens + 1)


class DecodePlan(Protocol):
    """A backend's own form of the step's attention rows, made before the forward and only read by it."""

    def next_step(self, decode: DecodeRows) -> DecodePlan: ...  # a window's next step, from this one
    def next_slots(self, positions: torch.Tensor) -> torch.Tensor: ...  # [R] cache slots of [R] positions


class StateSpan(NamedTuple):
    """A hybrid model's sequence in a step: its rows and its slot of the recurrent layers' state cache."""

    first_row: int
    num_tokens: int
    slot: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each scheduled token's K/V is written
    seqs: list[SeqSpan]  # prefill chunks (rows with more than one token, or no context yet), one by one
    decode: DecodeRows | None = None  # single-token rows with context (decode), attended in one call
    plan: DecodePlan | None = None  # the backend's, set by its prepare() before the forward
    state_spans: list[StateSpan] = field(default_factory=list)  # a hybrid's sequences, in batch order


@dataclass(frozen=True)
class DecodeGather:
    """torch's plan of the decode rows, on the model's device: every row's context gathered in one
    indexing op per layer, padded to the longest context and masked. Its size is rows x the longest
    context (not the sum of contexts): one long request makes every row's copy that long."""

    rows: torch.Tensor  # [R] int64, the rows of the flattened batch
    slots: torch.Tensor  # [R, max_len] int64, each context position's cache slot (padding: the row's first)
    is_padding: torch.Tensor  # [1, R, 1, max_len] bool, True past the row's context
    tables: torch.Tensor  # [R, max_blocks] int64 block tables, kept to derive a window's next step
    lens: torch.Tensor  # [R] int64 context lengths
    block_size: int

    def next_step(self, decode: DecodeRows) -> DecodeGather:
        """Derived on the device from this step's: no host-to-device copy."""
        return _gather_indices(self.rows, self.tables, self.lens + 1, self.block_size, self.slots.shape[1] + 1)

    def next_slots(self, positions: torch.Tensor) -> torch.Tensor:
        return slots_of(self.tables, positions, self.block_size)


def slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R] cache slots of `positions` (one per row, in row order), looked up in the block tables."""
    blocks = tables.gather(1, (positions // block_size)[:, None]).squeeze(1)
    return blocks.to(torch.int64) * block_size + positions % block_size


def _gather_indices(
    rows: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, block_size: int, max_len: int
) -> DecodeGather:
    offsets = torch.arange(block_size, dtype=torch.int64, device=tables.device)
    slots = (tables[:, :, None] * block_size + offsets).flatten(1)[:, :max_len]
    mask = torch.arange(max_len, device=tables.device)[None, :] < lens[:, None]
    # Padding reads the row's own first slot: never another request's blocks, whose stale values
    # (a NaN, say) would survive a zero weight.
    slots = torch.where(mask, slots, slots[:, :1])
    return DecodeGather(rows, slots, ~mask[None, :, None, :], tables, lens, block_size)


def decode_gather(rows: DecodeRows, device: torch.device) -> DecodeGather:
    """torch's plan, made once per step (once per window): three small host-to-device copies, the slot
    arithmetic on the device."""
    return _gather_indices(
        torch.from_numpy(rows.rows).to(device),
        torch.from_numpy(rows.block_tables).to(device=device, dtype=torch.int64),
        torch.from_numpy(rows.context_lens).to(device=device, dtype=torch.int64),
        rows.block_size,
        int(rows.context_lens.max()),
    )


def every_token_rows(meta: AttentionMetadata, block_size: int) -> DecodeRows:
    """Every token of the step as one decode row, attending to its own causal prefix in the cache: a
    prefill chunk's token at position p reads positions 0..p exactly as p's decode step would, so its
    attention is the same arithmetic whether it was prefilled (in any chunk) or decoded."""
    if not meta.seqs and meta.decode is not None:
        return meta.decode
    rows, tables, lens = [], [], []  # per part: [R] rows, [R, blocks] tables, [R] context lengths
    if meta.decode is not None:
        rows.append(meta.decode.rows)
        tables.append(meta.decode.block_tables)
        lens.append(meta.decode.context_lens)
    for seq in meta.seqs:
        table = np.concatenate(
            [np.arange(first // block_size, -(-(first + count) // block_size)) for first, count in seq.runs]
        ).astype(np.int32)
        rows.append(np.arange(seq.token_start, seq.token_start + seq.num_tokens, dtype=np.int64))
        tables.append(np.broadcast_to(table, (seq.num_tokens, len(table))))
        first_len = seq.context_len - seq.num_tokens + 1
        lens.append(np.arange(first_len, seq.context_len + 1, dtype=np.int32))
    stacked = np.zeros((sum(len(r) for r in rows), max(t.shape[1] for t in tables)), dtype=np.int32)
    start = 0
    for table in tables:
        stacked[start : start + table.shape[0], : table.shape[1]] = table
        start += table.shape[0]
    return DecodeRows(block_size, np.concatenate(rows), stacked, np.concatenate(lens))


# q [T, Hq, D], out [T, Hq, D] (its decode rows written), cache, the step's metadata (its decode rows
# and the backend's plan of them), the layer's attention spec, its sinks [Hq] or None
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, AttentionSpec, torch.Tensor | None], None
]


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]."""
    cache[0].index_copy_(1, slot_mapping, k.transpose(0, 1))
    cache[1].index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    spec: AttentionSpec,
    attend_decode: DecodeAttention,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] of this step (already in `cache`); sinks: [Hq], a logit a head
    that joins each softmax (gpt-oss), or None. Returns [T, Hq, D]: the decode rows by `attend_decode`,
    the prefill chunks one by one here."""
    assert spec.is_causal or meta.decode is None, "a bidirectional layer has no decode rows"
    out = torch.empty_like(q)
    if meta.decode is not None:
        attend_decode(q, out, cache, meta, spec, sinks)
    for seq in meta.seqs:
        rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
        out[rows] = _attend_chunk(q[rows], k[rows], v[rows], cache, seq, spec, sinks)
    return out


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, seq: SeqSpan, spec: AttentionSpec,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One prefill chunk: q [Tq, Hq, D], k and v [Tq, Hkv, D] of its own tokens; earlier positions
    come from the cache, only those some query's window still reaches."""
    window, scale, softcap = spec.window, spec.scale, spec.softcap
    if not spec.is_causal:
        return _attend_whole(q, k, v, seq, spec, sinks)
    if seq.context_len == seq.num_tokens:  # the whole context is this chunk
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        if (window is None or seq.num_tokens <= window) and softcap is None and sinks is None:  # plain causal
            return _sdpa(q, keys, values, None, True, scale)
        mask = _causal_mask(seq.num_tokens, seq.context_len, 0, window, q.device)
        return _sdpa(q, keys, values, mask, False, scale, softcap, sinks)
    first_key = 0 if window is None else max(0, seq.context_len - seq.num_tokens - window + 1)
    keys, values = _context(cache, _skip_slots(seq.runs, first_key))
    mask = _causal_mask(seq.num_tokens, seq.context_len, first_key, window, q.device)
    return _sdpa(q, keys, values, mask, False, scale, softcap, sinks)


def _attend_whole(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqSpan, spec: AttentionSpec, sinks: torch.Tensor | None
) -> torch.Tensor:
    """A bidirectional layer over a whole prompt (the pooling runner schedules it in one step): every query
    attends to every key within the window either side. One request's call, its shapes its own, so its
    numbers do not depend on the batch."""
    assert seq.context_len == seq.num_tokens, "a bidirectional layer attends to a whole prompt in one step"
    keys, values, window = k.transpose(0, 1), v.transpose(0, 1), spec.window
    mask = None
    if window is not None and seq.num_tokens > window:
        positions = torch.arange(seq.num_tokens, device=q.device)
        mask = (positions[:, None] - positions[None, :]).abs() < window
    if mask is None and (spec.softcap is not None or sinks is not None):
        mask = torch.ones(seq.num_tokens, seq.num_tokens, dtype=torch.bool, device=q.device)
    return _sdpa(q, keys, values, mask, False, spec.scale, spec.softcap, sinks)


def _causal_mask(
    num_tokens: int, context_len: int, first_key: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[Tq, L - first_key] bool, True where a query (the last Tq positions) may attend to a key."""
    positions = torch.arange(context_len - num_tokens, context_len, device=device)[:, None]
    keys = torch.arange(first_key, context_len, device=device)[None, :]
    mask = keys <= positions
    if window is not None:
        mask &= keys > positions - window
    return mask


def _skip_slots(runs: list[tuple[int, int]], num_skipped: int) -> list[tuple[int, int]]:
    """The runs without their first `num_skipped` slots (positions that slid out of every window)."""
    kept = []
    for start, length in runs:
        if num_skipped >= length:
            num_skipped -= length
            continue
        kept.append((start + num_skipped, length - num_skipped))
        num_skipped = 0
    return kept


def decode_attention_torch(
    q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, spec: AttentionSpec,
    sinks: torch.Tensor | None = None,
) -> None:
    """Writes the decode rows of `out`: one gather of every row's keys and values, two batched products
    over (KV head, row), the padding masked. Scores in the model's dtype, softmax in fp32 as SDPA does."""
    gather, window, scale, softcap = meta.plan, spec.window, spec.scale, spec.softcap
    assert isinstance(gather, DecodeGather), "torch's decode attention reads TorchBackend's plan"
    num_rows, (_, num_kv_heads, _, head_dim) = len(gather.rows), cache.shape
    group = q.shape[1] // num_kv_heads
    shape = (num_kv_heads, num_rows, gather.slots.shape[1], head_dim)  # [Hkv, R, L, D]
    flat = gather.slots.reshape(-1)  # index_select: faster than advanced indexing on the CPU
    keys, values = cache[0].index_select(1, flat).view(shape), cache[1].index_select(1, flat).view(shape)
    grouped_q = (q[gather.rows] * (head_dim**-0.5 if scale is None else scale)).view(num_rows, num_kv_heads, group, head_dim)
    scores = torch.matmul(grouped_q.transpose(0, 1), keys.transpose(2, 3))  # [Hkv, R, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    is_masked = gather.is_padding
    if window is not None:  # also the positions that slid out of the window
        positions = torch.arange(gather.slots.shape[1], device=q.device)
        is_masked = is_masked | (positions[None, :] <= gather.lens[:, None] - 1 - window)[None, :, None, :]
    scores.masked_fill_(is_masked, float("-inf"))
    column = None if sinks is None else sinks.view(num_kv_heads, 1, group, 1).expand(-1, num_rows, -1, -1)
    weights = softmax_with_sinks(scores, column)  # a sink a head: a column [Hkv, R, G, 1] beside the scores
    attended = torch.matmul(weights, values)  # [Hkv, R, G, D]
    out[gather.rows] = attended.transpose(0, 1).reshape(num_rows, -1, head_dim)


def _context(cache: torch.Tensor, runs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[Hkv, L, D] keys and values: a view for one run, a copy only when the blocks are fragmented."""
    if len(runs) == 1:
        start, length = runs[0]
        return cache[0, :, start : start + length], cache[1, :, start : start + length]
    keys = torch.cat([cache[0, :, s : s + n] for s, n in runs], dim=1)
    values = torch.cat([cache[1, :, s : s + n] for s, n in runs], dim=1)
    return keys, values


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """scores [..., L] and a sink logit a row [..., 1] or None -> the weights [..., L] in scores' dtype, the
    softmax in fp32; with sinks HF's gpt-oss one: the sink a last column (the maximum over both
    subtracted), dropped after it."""
    if sinks is None:
        return scores.softmax(dim=-1, dtype=torch.float32).to(scores.dtype)
    combined = torch.cat((scores, sinks.to(scores.dtype)), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return combined.softmax(dim=-1, dtype=torch.float32)[..., :-1].to(scores.dtype)


def _sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, is_causal: bool,
    scale: float | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [Tq, Hq, D]; keys, values: [Hkv, L, D]. Returns [Tq, Hq, D]. With a soft-cap or sinks (which
    SDPA has not): the scores, capped, masked, their softmax in fp32 (beside the sinks), written out."""
    if softcap is not None or sinks is not None:
        group = q.shape[1] // keys.shape[0]
        keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = torch.matmul(q.transpose(0, 1) * scale, keys.transpose(1, 2))  # [Hq, Tq, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        column = None if sinks is None else sinks[:, None, None].expand(-1, scores.shape[1], 1)
        weights = softmax_with_sinks(scores, column).to(values.dtype)
        return torch.matmul(weights, values).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=True, scale=scale
    )
    return out.transpose(0, 1)
