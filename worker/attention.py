"""Paged attention over a flat slot cache, in torch (engine-core process).

Each layer's cache is `[2, num_slots, num_kv_heads, head_dim]` with slot = block_id * block_size + offset.
Decode rows (one query token) are batched into one call; prefill chunks run one request at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    token_start: int  # first row of this request's tokens in the flattened batch
    num_tokens: int  # query tokens in this step
    context_slots: torch.Tensor | None  # [context_len] int64 cache slots; None: no earlier context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each scheduled token's K/V is written
    decode_rows: torch.Tensor | None  # [num_decodes] int64 token rows with a single query token
    decode_slots: torch.Tensor | None  # [num_decodes, max_context_len] int64, padded with slot 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context_len] bool, True = attend
    prefills: list[PrefillSpan]


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]."""
    cache[0].index_copy_(0, slot_mapping, k)
    cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] of this step (already written to `cache`). Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = _decode_attention(q[meta.decode_rows], cache, meta)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], cache, span)
    return out


def _decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    keys = cache[0][meta.decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = cache[1][meta.decode_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True
    )  # [B, Hq, 1, D]
    return out.squeeze(2)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, span: PrefillSpan
) -> torch.Tensor:
    if span.context_slots is None:  # the whole context is this chunk: plain causal attention
        keys, values, mask, is_causal = k, v, None, True
    else:
        keys, values = cache[0][span.context_slots], cache[1][span.context_slots]
        context_len, num_new = keys.shape[0], q.shape[0]
        query_pos = torch.arange(context_len - num_new, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= query_pos[:, None]  # [Tq, L]
        is_causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=is_causal,
        enable_gqa=True,
    )  # [Hq, Tq, D]
    return out.transpose(0, 1)
