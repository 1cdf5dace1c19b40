"""What the RL tests (test_rl_api, test_rl_daemon, test_rl_data_parallel) compare the engine with: HF's
prompt logprobs of a sequence, and an HF model whose weights a "trainer step" moved."""

from __future__ import annotations

import torch
from conftest import load_hf


def hf_scored(model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1] float32: HF's logprob of each token after the first, given the ones before it."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids[1:]).unsqueeze(1))[:, 0]


def perturb(model, seed: int) -> None:
    """Every weight moved by seeded noise of 0.2 of its mean magnitude, in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.2 * param.abs().mean())


def perturbed_hf(path: str, seed: int):
    """The HF model of `path`, perturbed (`perturb`)."""
    model = load_hf(path)
    perturb(model, seed)
    return model
