"""Logprob rows on the device: chosen token first, then the top-k, and the chosen token's rank (core
process). The vocabulary-wide passes (top-k with the log-sum-exp, argmax) are a backend's
`SamplingOps`: torch's here, the C kernels' in coreserve/worker/cpu/sampling_ops.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class TopLogprobs:
    top_scores: torch.Tensor  # [R, K] float32 the K largest of `scores`, largest first
    ids: torch.Tensor  # [R, K] int64 their token ids
    scores: torch.Tensor  # [R, V] float32 the rows they come from: logprobs, or raw when `lse` is set
    lse: torch.Tensor | None  # [R, 1] float32 log-sum-exp of `scores`; None when they are logprobs

    def logprobs(self, scores: torch.Tensor) -> torch.Tensor:
        """Values taken from `self.scores` as logprobs."""
        return scores if self.lse is None else scores - self.lse


class SamplingOps(Protocol):
    """A backend's vocabulary-wide passes over logits [R, V] float32."""

    def top_logprobs(self, scores: torch.Tensor, k: int) -> TopLogprobs: ...
    def argmax(self, scores: torch.Tensor) -> torch.Tensor: ...  # [R] int64, lowest id among equals


def top_count(scores: torch.Tensor, k: int) -> int:
    """How many top entries a row keeps for k (-1: the whole vocabulary; 0 keeps one, for the argmax)."""
    return scores.shape[-1] if k == -1 else min(max(k, 1), scores.shape[-1])


class TorchSamplingOps:
    """log_softmax and topk, torch's argmax: any device."""

    def top_logprobs(self, scores: torch.Tensor, k: int) -> TopLogprobs:
        logprobs = torch.log_softmax(scores, dim=-1)
        top = logprobs.topk(top_count(scores, k), dim=-1)
        return TopLogprobs(top.values, top.indices, logprobs, None)

    def argmax(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.argmax(dim=-1)


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
