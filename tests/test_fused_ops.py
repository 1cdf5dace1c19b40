"""worker/fused_ops.c's RMSNorm (with and without the residual add before it) against HF's formula."""

from __future__ import annotations

import pytest
import torch

from worker.cpu_kernels import load_cpu_kernels, rms_norm


@pytest.mark.parametrize("num_tokens, hidden", [(1, 768), (3, 17), (700, 256)])  # 700: threaded
def test_rms_norm_and_residual_add_match_hf_formula(num_tokens, hidden):
    kernels = load_cpu_kernels()
    assert kernels is not None
    generator = torch.Generator().manual_seed(hidden)
    x, delta = torch.randn(2, num_tokens, hidden, generator=generator) * 3
    weight = torch.randn(hidden, generator=generator)

    def hf(values: torch.Tensor) -> torch.Tensor:
        return weight * (values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + 1e-5))

    same, normed = rms_norm(kernels, x, weight, 1e-5)
    assert same is x
    torch.testing.assert_close(normed, hf(x), rtol=2e-6, atol=2e-6)
    total, normed = rms_norm(kernels, x, weight, 1e-5, delta)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, hf(x + delta), rtol=2e-6, atol=2e-6)
