"""Paged attention over a head-major slot cache, in torch (engine-core process).

Each layer's cache is `[2, num_kv_heads, num_slots, head_dim]`, slot = block_id * block_size + offset.
The KV manager places each request's blocks in contiguous runs where it can, so a request's context
is usually one run: a view of the cache, read in place with no gather copy. This CPU is short of
memory bandwidth, and copying the context every layer of every step cost more than the attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker.cpu_kernels import CpuKernels, decode_attention


@dataclass
class SeqSpan:
    token_start: int  # first row of this request's tokens in the flattened batch
    num_tokens: int  # query tokens this step
    context_len: int  # tokens attended to, this step's included
    runs: list[tuple[int, int]]  # (first slot, number of slots) covering positions 0..context_len - 1


@dataclass
class DecodeRows:
    """Single-token rows attended by the C kernel in one call per layer (host arrays, CPU only)."""

    block_size: int
    rows: np.ndarray  # [R] int64, the rows of the flattened batch
    block_tables: np.ndarray  # [R, max_blocks] int32, each request's blocks, zero padded
    context_lens: np.ndarray  # [R] int32, tokens attended to, this step's included


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each scheduled token's K/V is written
    seqs: list[SeqSpan]  # requests attended by the torch path
    decode: DecodeRows | None = None  # set only with `kernels`
    kernels: CpuKernels | None = None  # the CPU kernels (fp32 on the CPU): decode attention, fused steps


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]."""
    cache[0].index_copy_(1, slot_mapping, k.transpose(0, 1))
    cache[1].index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] of this step (already in `cache`). Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    num_tokens, num_kv_heads, head_dim = q.shape[0], k.shape[1], k.shape[2]
    if meta.decode is not None:
        rows = meta.decode
        decode_attention(
            meta.kernels,
            q,
            out,
            cache,
            rows.rows,
            rows.block_tables,
            rows.context_lens,
            rows.block_size,
            head_dim**-0.5,
        )
    if not meta.seqs:
        return out
    group = q.shape[1] // num_kv_heads
    grouped_q = (q * head_dim**-0.5).view(num_tokens, num_kv_heads, group, head_dim)  # query heads by KV head
    grouped_out = out.view(num_tokens, num_kv_heads, group, head_dim)
    key_cache, value_cache = cache[0], cache[1]
    for seq in meta.seqs:
        row = seq.token_start
        if seq.num_tokens == 1 and seq.context_len > 1 and len(seq.runs) == 1:  # decode: read in place
            start, length = seq.runs[0]
            end = start + length
            scores = torch.bmm(grouped_q[row], key_cache[:, start:end].transpose(1, 2))  # [Hkv, G, L]
            weights = scores.softmax(dim=-1, dtype=torch.float32).to(scores.dtype)  # fp32, as SDPA does
            torch.bmm(weights, value_cache[:, start:end], out=grouped_out[row])
            continue
        rows = slice(row, row + seq.num_tokens)
        if seq.context_len == seq.num_tokens:  # the whole context is this chunk: plain causal attention
            out[rows] = _sdpa(q[rows], k[rows].transpose(0, 1), v[rows].transpose(0, 1), None, True)
        else:
            keys, values = _context(cache, seq.runs)
            positions = torch.arange(seq.context_len - seq.num_tokens, seq.context_len, device=q.device)
            mask = torch.arange(seq.context_len, device=q.device)[None, :] <= positions[:, None]  # [Tq, L]
            out[rows] = _sdpa(q[rows], keys, values, mask, False)
    return out


def _context(cache: torch.Tensor, runs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[Hkv, L, D] keys and values: a view for one run, a copy only when the blocks are fragmented."""
    if len(runs) == 1:
        start, length = runs[0]
        return cache[0, :, start : start + length], cache[1, :, start : start + length]
    keys = torch.cat([cache[0, :, s : s + n] for s, n in runs], dim=1)
    values = torch.cat([cache[1, :, s : s + n] for s, n in runs], dim=1)
    return keys, values


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, is_causal: bool) -> torch.Tensor:
    """q: [Tq, Hq, D]; keys, values: [Hkv, L, D]. Returns [Tq, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=True
    )
    return out.transpose(0, 1)
