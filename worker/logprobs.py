"""Logprob rows on the device: chosen token first, then the top-k, and the chosen token's rank (core process)."""

from __future__ import annotations

from collections.abc import Callable

import torch

PROMPT_LOGITS_SLICE_ROWS = 256  # prompt positions per lm_head slice: bounds memory to rows x vocab floats


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, k: int, top=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs: [R, V] float32 log_softmax rows; chosen: [R] int64; k: top-k to add (-1: whole
    vocabulary); `top`: `logprobs.topk(max(k, 1))` when the caller has it already.

    Returns token_ids [R, k + 1] int32, values [R, k + 1] float32, ranks [R] int32 where rank is
    1 + the number of tokens with a strictly higher logprob than the chosen one.
    """
    k = logprobs.shape[-1] if k == -1 else k
    top = logprobs.topk(max(k, 1), dim=-1) if top is None else top
    chosen = chosen.unsqueeze(-1)
    chosen_logprob = logprobs.gather(-1, chosen)  # [R, 1]
    ranks = _ranks(logprobs, top.values, chosen_logprob)
    token_ids = torch.cat((chosen, top.indices[:, :k]), dim=-1).to(torch.int32)
    return token_ids, torch.cat((chosen_logprob, top.values[:, :k]), dim=-1), ranks


def _ranks(logprobs: torch.Tensor, top_values: torch.Tensor, chosen_logprob: torch.Tensor) -> torch.Tensor:
    """1 + tokens strictly above the chosen one. Every such token is in the top-k when the chosen
    logprob reaches the k-th value, so the top-k alone answers (the usual case: greedy rows, most
    sampled ones); otherwise a full pass over the vocabulary. The shortcut's test is a host sync, so
    it is taken on the CPU only, where a sync is free and the full pass is not."""
    if logprobs.device.type == "cpu" and bool((chosen_logprob >= top_values[:, -1:]).all()):
        return (top_values > chosen_logprob).sum(-1, dtype=torch.int32) + 1
    return (logprobs > chosen_logprob).sum(-1, dtype=torch.int32) + 1


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
