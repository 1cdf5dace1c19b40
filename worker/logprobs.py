"""Logprob rows on the device: chosen token first, then the top-k, and the chosen token's rank (core process)."""

from __future__ import annotations

from collections.abc import Callable

import torch

PROMPT_LOGITS_SLICE_ROWS = 256  # prompt positions per lm_head slice: bounds memory to rows x vocab floats


def gather_logprobs(
    scores: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores: [R, V] float32 logits (log_softmax is applied here); chosen: [R] int64; k: top-k to add
    (-1: whole vocabulary).

    Returns token_ids [R, k + 1] int32, values [R, k + 1] float32 logprobs, ranks [R] int32 where rank
    is 1 + the number of tokens with a strictly higher logprob than the chosen one. Only the returned
    entries are normalized (score - logsumexp): no [R, V] logprob tensor is written.
    """
    k = scores.shape[-1] if k == -1 else k
    log_normalizer = torch.logsumexp(scores, dim=-1, keepdim=True)  # [R, 1]
    chosen = chosen.unsqueeze(-1)
    chosen_score = scores.gather(-1, chosen)  # [R, 1]
    ranks = (scores > chosen_score).sum(-1, dtype=torch.int32) + 1
    if k == 0:
        return chosen.to(torch.int32), chosen_score - log_normalizer, ranks
    top = scores.topk(k, dim=-1)
    token_ids = torch.cat((chosen, top.indices), dim=-1).to(torch.int32)
    return token_ids, torch.cat((chosen_score, top.values), dim=-1) - log_normalizer, ranks


def prompt_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden: [P, H] states of the positions before each target; targets: [P] next prompt tokens.

    The vocabulary-wide logits are made a slice of rows at a time so long prompts stay bounded.
    """
    parts = []
    for start in range(0, hidden.shape[0], PROMPT_LOGITS_SLICE_ROWS):
        rows = slice(start, start + PROMPT_LOGITS_SLICE_ROWS)
        parts.append(gather_logprobs(compute_logits(hidden[rows]), targets[rows], k))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(column) for column in zip(*parts))


def copy_to_host(tensors: list[torch.Tensor]) -> list:
    """One device-to-host copy for many int32/float32 tensors: packed into one int32 buffer, then split."""
    import numpy as np

    if not tensors:
        return []
    flat = [
        t.contiguous().view(torch.int32).reshape(-1)
        if t.dtype == torch.float32
        else t.to(torch.int32).reshape(-1)
        for t in tensors
    ]
    host = torch.cat(flat).cpu().numpy()
    out, offset = [], 0
    for tensor in tensors:
        size = tensor.numel()
        chunk = host[offset : offset + size].reshape(tuple(tensor.shape))
        out.append(chunk.view(np.float32) if tensor.dtype == torch.float32 else chunk)
        offset += size
    return out
