"""Sampler and logprob rows on small hand-made logits (no model)."""

from __future__ import annotations

import pytest
import torch

from coreserve.worker.cpu.kernels import argmax_rows, load_cpu_kernels
from coreserve.worker.cpu.sampling_ops import CpuSamplingOps
from coreserve.worker.sampling.logprobs import TorchSamplingOps, gather_logprobs


@pytest.fixture(scope="module", params=["torch", "kernel"])
def kernels(request):
    """Both paths: log_softmax + topk, and the C pass (this machine has a compiler: it must build)."""
    if request.param == "torch":
        return None
    loaded = load_cpu_kernels()
    assert loaded is not None
    return loaded


def top_logprobs(scores, k: int, kernels=None):
    """The backend's sampling ops: torch's (kernels None) or the C pass."""
    ops = TorchSamplingOps() if kernels is None else CpuSamplingOps(kernels)
    return ops.top_logprobs(scores, k)


def brute_force_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    return [int((row > row[c]).sum()) + 1 for row, c in zip(logprobs, chosen.tolist())]


def test_ranks_match_a_full_count_inside_and_outside_the_top_k(kernels):
    torch.manual_seed(0)
    scores = torch.randn(6, 1000) * 3
    logprobs = torch.log_softmax(scores, dim=-1)
    order = logprobs.argsort(dim=-1, descending=True)
    for place in (0, 2, 4, 5, 300):  # within the top-5, at its edge, and far below it
        chosen = order[:, place]
        token_ids, values, ranks = gather_logprobs(top_logprobs(scores, 5, kernels), chosen, 5)
        assert ranks.tolist() == brute_force_ranks(logprobs, chosen) == [place + 1] * 6
        assert token_ids[:, 0].tolist() == chosen.tolist()
        assert token_ids[:, 1:].tolist() == order[:, :5].tolist()
        torch.testing.assert_close(
            values[:, 0], logprobs.gather(-1, chosen[:, None])[:, 0], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(values[:, 1:], logprobs.gather(-1, order[:, :5]), atol=1e-5, rtol=0)


def test_ties_at_the_edge_of_the_top_k_count_only_strictly_higher_tokens(kernels):
    scores = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0]])
    top = top_logprobs(scores, 2, kernels)
    _, _, ranks = gather_logprobs(top, torch.tensor([4]), 2)
    assert ranks.tolist() == [3]


def test_kernel_keeps_the_lower_token_id_first_among_equals_as_argmax_does():
    kernels = load_cpu_kernels()
    scores = torch.randn(3, 5000)
    scores[:, [4100, 17, 2500]] = 30.0  # a three-way tie at the top, listed out of order
    scores[1, 2600:4000] = float("-inf")  # masked tokens (top-k/top-p processing) are allowed
    top = top_logprobs(scores, 4, kernels)
    assert top.ids[:, :3].tolist() == [[17, 2500, 4100]] * 3
    assert top.ids[:, 0].tolist() == scores.argmax(dim=-1).tolist()
    torch.testing.assert_close(top.lse, torch.logsumexp(scores, dim=-1, keepdim=True))


def test_zero_and_whole_vocabulary():
    logprobs = torch.log_softmax(torch.randn(2, 50), dim=-1)
    chosen = torch.tensor([7, 9])
    token_ids, _, _ = gather_logprobs(top_logprobs(logprobs, 0), chosen, 0)
    assert token_ids.tolist() == [[7], [9]]
    token_ids, values, _ = gather_logprobs(top_logprobs(logprobs, -1), chosen, -1)
    assert token_ids.shape == (2, 51) and torch.allclose(values[:, 1:].exp().sum(-1), torch.ones(2))


def test_penalty_counts_advanced_on_the_device_equal_counts_rebuilt_from_the_tokens():
    """A multi-step window advances the penalties' counts in place; after each step they must be what
    N = 1 rebuilds from the real token lists (output counts, and the seen mask over prompt + output)."""
    from coreserve.protocol.sampling_params import SamplingParams
    from coreserve.worker.sampling.metadata import build_sampling_metadata
    from coreserve.worker.sampling.sampler import advance_penalties
    from coreserve.worker.step.input_batch import RequestState

    params = SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4)
    states = [RequestState(str(i), [3, 9, 4 + i], 2, params, [0], 3, None, None, False, []) for i in range(3)]
    meta = build_sampling_metadata(states, 50, torch.device("cpu"))
    for sampled in ([7, 7, 1], [7, 2, 1], [9, 9, 9]):
        advance_penalties(meta.penalties, torch.tensor(sampled))
        for state, token in zip(states, sampled):
            state.token_ids.append(token)
        rebuilt = build_sampling_metadata(states, 50, torch.device("cpu")).penalties
        assert torch.equal(meta.penalties.output_counts, rebuilt.output_counts)
        assert torch.equal(meta.penalties.seen_mask, rebuilt.seen_mask)


def test_argmax_kernel_equals_torch_argmax_with_ties_nans_and_infinities():
    kernels = load_cpu_kernels()
    assert kernels is not None
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(7, 50_257, generator=generator)
    scores[1, 100] = scores[1, 40_000] = scores[1].max() + 1  # a tie: the lower id wins
    scores[2] = float("-inf")  # every score -inf: id 0, as torch
    scores[3, 9] = float("inf")
    scores[4, 70], scores[4, 30_000] = float("nan"), float("inf")  # a NaN counts as the largest
    scores[5, -1] = 100.0  # the tail past the last 8-lane block
    expected = scores.argmax(dim=-1)
    assert torch.equal(argmax_rows(kernels, scores), expected)
    assert torch.equal(
        argmax_rows(kernels, scores[:, :13]), scores[:, :13].argmax(dim=-1)
    )  # short, strided rows
