"""Logprob rows on the device: chosen token first, then the top-k, and the chosen token's rank (core process)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.cpu.kernels import CpuKernels, logprob_rows

PROMPT_LOGITS_SLICE_ROWS = 256  # prompt positions per lm_head slice: bounds memory to rows x vocab floats


KERNEL_MAX_K = 64  # the C pass keeps the top k in a sorted array: fast for the k users ask for


@dataclass
class TopLogprobs:
    top_scores: torch.Tensor  # [R, K] float32 the K largest of `scores`, largest first
    ids: torch.Tensor  # [R, K] int64 their token ids
    scores: torch.Tensor  # [R, V] float32 the rows they come from: logprobs, or raw when `lse` is set
    lse: torch.Tensor | None  # [R, 1] float32 log-sum-exp of `scores`; None when they are logprobs

    def logprobs(self, scores: torch.Tensor) -> torch.Tensor:
        """Values taken from `self.scores` as logprobs."""
        return scores if self.lse is None else scores - self.lse


def top_logprobs(scores: torch.Tensor, k: int, kernels: CpuKernels | None = None) -> TopLogprobs:
    """The top-k (-1: the whole vocabulary; 0 keeps one, for the argmax) of each row of `scores`
    [R, V]: on the CPU one C pass (k up to KERNEL_MAX_K) that never writes the [R, V] logprobs;
    elsewhere log_softmax and topk."""
    num = scores.shape[-1] if k == -1 else min(max(k, 1), scores.shape[-1])
    if kernels is not None and scores.device.type == "cpu" and num <= KERNEL_MAX_K:
        top_scores, ids, lse = logprob_rows(kernels, scores.contiguous(), num)
        return TopLogprobs(top_scores, ids, scores, lse)
    logprobs = torch.log_softmax(scores, dim=-1)
    top = logprobs.topk(num, dim=-1)
    return TopLogprobs(top.values, top.indices, logprobs, None)


def gather_logprobs(top: TopLogprobs, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """chosen: [R] int64; k: top-k to add (-1: whole vocabulary; `top` must hold at least k).

    Returns token_ids [R, k + 1] int32, values [R, k + 1] float32, ranks [R] int32 where rank is
    1 + the number of tokens with a strictly higher logprob than the chosen one.
    """
    k = top.scores.shape[-1] if k == -1 else k
    chosen = chosen.unsqueeze(-1)
    chosen_score = top.scores.gather(-1, chosen)  # [R, 1]
    ranks = _ranks(top, chosen_score)
    token_ids = torch.cat((chosen, top.ids[:, :k]), dim=-1).to(torch.int32)
    return token_ids, top.logprobs(torch.cat((chosen_score, top.top_scores[:, :k]), dim=-1)), ranks


def _ranks(top: TopLogprobs, chosen_score: torch.Tensor) -> torch.Tensor:
    """1 + tokens strictly above the chosen one. Every such token is in the top-k when the chosen
    logprob reaches the k-th value, so the top-k alone answers (the usual case: greedy rows, most
    sampled ones); otherwise a full pass over the vocabulary. The shortcut's test is a host sync, so
    it is taken on the CPU only, where a sync is free and the full pass is not."""
    # Compared in the space of `scores`, both ways: two raw scores can round to one logprob, and a
    # row's rank must not depend on which way the rest of the batch sent it.
    if top.scores.device.type == "cpu" and bool((chosen_score >= top.top_scores[:, -1:]).all()):
        return (top.top_scores > chosen_score).sum(-1, dtype=torch.int32) + 1
    return (top.scores > chosen_score).sum(-1, dtype=torch.int32) + 1


def prompt_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    kernels: CpuKernels | None = None,
    candidates: torch.Tensor | None = None,
    temperature: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """hidden: [P, H] states of the positions before each target; targets: [P] next prompt tokens;
    candidates: [P, C] int64 ids scored too (prompt_logprob_token_ids), their columns after the top-k
    and their ranks [P, C] int32 a fourth tensor; temperature: the rows are logits / T.

    The vocabulary-wide logits are made a slice of rows at a time so long prompts stay bounded.
    """
    parts = []
    for start in range(0, hidden.shape[0], PROMPT_LOGITS_SLICE_ROWS):
        rows = slice(start, start + PROMPT_LOGITS_SLICE_ROWS)
        logits = compute_logits(hidden[rows])
        if temperature is not None:  # divided by a float32 tensor as the sampler does: the same bits
            logits = logits.float() / torch.full(
                (1, 1), temperature, dtype=torch.float32, device=logits.device
            )
        top = top_logprobs(logits, k, kernels)
        part = gather_logprobs(top, targets[rows], k)
        if candidates is not None:
            part = with_candidates(top, part, candidates[rows])
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(column) for column in zip(*parts))


def with_candidates(
    top: TopLogprobs, part: tuple[torch.Tensor, ...], candidates: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """`part` (token_ids, values, ranks) with the candidates' [R, C] columns appended, taken from the same
    scores as column 0 (so a candidate that is the prompt token has its bits), and their ranks."""
    token_ids, values, ranks = part
    scores = top.scores.gather(-1, candidates)  # [R, C]
    # 1 + the tokens strictly above each candidate, as _ranks counts: one sort per row, then a search.
    ascending = top.scores.sort(dim=-1).values
    num_not_above = torch.searchsorted(ascending, scores.contiguous(), right=True)
    candidate_ranks = (top.scores.shape[-1] - num_not_above + 1).to(torch.int32)
    return (
        torch.cat((token_ids, candidates.to(torch.int32)), dim=-1),
        torch.cat((values, top.logprobs(scores)), dim=-1),
        ranks,
        candidate_ranks,
    )


def candidate_ids(
    rows: list[list[int]] | None, first_position: int, num_rows: int, device: torch.device
) -> torch.Tensor | None:
    """[num_rows, C] int64 candidates of prompt positions first_position.. (prompt_logprob_token_ids:
    one row for every position, or one per position); None when the request named none."""
    if rows is None:
        return None
    if len(rows) == 1:
        return torch.tensor(rows, dtype=torch.int64, device=device).expand(num_rows, -1)
    return torch.tensor(rows[first_position : first_position + num_rows], dtype=torch.int64, device=device)


def copy_to_host(tensors: list[torch.Tensor]) -> list:
    """One device-to-host copy for many int32/float32 tensors: packed into one int32 buffer, then split.
    On the CPU, where the device is the host, each is copied out through numpy instead (a handful of
    torch calls fewer a step: each costs tens of us once the step's weights have evicted torch's
    code from the caches)."""
    import numpy as np

    if not tensors:
        return []
    if all(t.is_cpu for t in tensors):
        return [
            np.array(t.numpy(), dtype=np.float32 if t.dtype == torch.float32 else np.int32) for t in tensors
        ]
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
