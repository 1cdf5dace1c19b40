"""Logprob rows on the device: chosen token first, then the top-k, and the chosen token's rank (core process)."""

from __future__ import annotations

from collections.abc import Callable

import torch

PROMPT_LOGITS_SLICE_ROWS = 256  # prompt positions per lm_head slice: bounds memory to rows x vocab floats


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs: [R, V] float32; chosen: [R] int64; k: top-k to add (-1: whole vocabulary).

    Returns token_ids [R, k + 1] int32, values [R, k + 1] float32, ranks [R] int32 where rank is
    1 + the number of tokens with a strictly higher logprob than the chosen one.
    """
    k = logprobs.shape[-1] if k == -1 else k
    chosen = chosen.unsqueeze(-1)
    chosen_logprob = logprobs.gather(-1, chosen)  # [R, 1]
    ranks = (logprobs > chosen_logprob).sum(-1, dtype=torch.int32) + 1
    if k == 0:
        return chosen.to(torch.int32), chosen_logprob, ranks
    top = logprobs.topk(k, dim=-1)
    token_ids = torch.cat((chosen, top.indices), dim=-1).to(torch.int32)
    return token_ids, torch.cat((chosen_logprob, top.values), dim=-1), ranks


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
        logprobs = torch.log_softmax(compute_logits(hidden[rows]), dim=-1)
        parts.append(gather_logprobs(logprobs, targets[rows], k))
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
