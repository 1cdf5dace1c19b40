"""Sampler and logprob rows on small hand-made logits (no model)."""

from __future__ import annotations

import torch

from worker.logprobs import gather_logprobs


def brute_force_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    return [int((row > row[c]).sum()) + 1 for row, c in zip(logprobs, chosen.tolist())]


def test_ranks_match_a_full_count_inside_and_outside_the_top_k():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(6, 1000) * 3, dim=-1)
    order = logprobs.argsort(dim=-1, descending=True)
    for place in (0, 2, 4, 5, 300):  # within the top-5, at its edge, and far below it
        chosen = order[:, place]
        token_ids, values, ranks = gather_logprobs(logprobs, chosen, 5)
        assert ranks.tolist() == brute_force_ranks(logprobs, chosen) == [place + 1] * 6
        assert token_ids[:, 0].tolist() == chosen.tolist()
        assert token_ids[:, 1:].tolist() == order[:, :5].tolist()
        assert torch.equal(values[:, 0], logprobs.gather(-1, chosen[:, None])[:, 0])


def test_ties_at_the_edge_of_the_top_k_count_only_strictly_higher_tokens():
    logprobs = torch.log_softmax(torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0]]), dim=-1)
    _, _, ranks = gather_logprobs(logprobs, torch.tensor([4]), 2)
    assert ranks.tolist() == [3]


def test_zero_and_whole_vocabulary():
    logprobs = torch.log_softmax(torch.randn(2, 50), dim=-1)
    chosen = torch.tensor([7, 9])
    token_ids, _, _ = gather_logprobs(logprobs, chosen, 0)
    assert token_ids.tolist() == [[7], [9]]
    token_ids, values, _ = gather_logprobs(logprobs, chosen, -1)
    assert token_ids.shape == (2, 51) and torch.allclose(values[:, 1:].exp().sum(-1), torch.ones(2))
