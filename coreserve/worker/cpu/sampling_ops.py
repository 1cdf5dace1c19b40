"""The CPU backend's sampling ops: the top-k logprob rows and the argmax in one C pass each over the
logits, which never writes the [R, V] logprobs (engine-core process)."""

from __future__ import annotations

import torch

from coreserve.worker.cpu.bindings import CpuKernels
from coreserve.worker.cpu.kernels import argmax_rows, logprob_rows
from coreserve.worker.sampling.logprobs import TopLogprobs, TorchSamplingOps, top_count

KERNEL_MAX_K = 64  # the C pass keeps the top k in a sorted array: fast for the k users ask for


class CpuSamplingOps:
    """fp32 logits on the CPU; a k past KERNEL_MAX_K (or the whole vocabulary) takes torch's pass."""

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self.torch_ops = TorchSamplingOps()

    def top_logprobs(self, scores: torch.Tensor, k: int) -> TopLogprobs:
        num = top_count(scores, k)
        if num > KERNEL_MAX_K:
            return self.torch_ops.top_logprobs(scores, k)
        top_scores, ids, lse = logprob_rows(self.kernels, scores.contiguous(), num)
        return TopLogprobs(top_scores, ids, scores, lse)

    def argmax(self, scores: torch.Tensor) -> torch.Tensor:
        return argmax_rows(self.kernels, scores)
