"""coreserve/worker/cpu/csrc/fused_ops.c against torch's ops: RMSNorm (with and without the residual add before it) as
HF writes it, SiLU-and-multiply, and RoPE with the KV-cache write; one token (the calling thread alone)
and many (threaded)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coreserve.worker.cpu.kernels import load_cpu_kernels, rms_norm, rope_write_kv, silu_mul


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


@pytest.mark.parametrize("num_tokens, intermediate", [(1, 2048), (2, 13), (300, 1000)])  # 300: threaded
def test_silu_mul_matches_torch(num_tokens, intermediate):
    kernels = load_cpu_kernels()
    assert kernels is not None
    gate_up = torch.randn(num_tokens, 2 * intermediate, generator=torch.Generator().manual_seed(1)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(kernels, gate_up), F.silu(gate) * up, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("num_tokens", [1, 3, 2000])  # 2000: threaded
def test_rope_write_kv_matches_rotate_half_and_writes_the_slots(num_tokens):
    kernels = load_cpu_kernels()
    assert kernels is not None
    num_q_heads, num_kv_heads, head_dim, num_slots = 6, 2, 24, 4096
    generator = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=generator) * 6
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    half = head_dim // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    cache = torch.zeros(2, num_kv_heads, num_slots, head_dim)
    q, k, v = rope_write_kv(
        kernels, qkv, cos.contiguous(), signed_sin.contiguous(), slots, num_q_heads, cache
    )

    def rotated(x: torch.Tensor) -> torch.Tensor:  # HF: x * cos + rotate_half(x) * sin
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    q_ref, k_ref, v_ref = qkv.split(
        [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    torch.testing.assert_close(
        q, rotated(q_ref.view(num_tokens, num_q_heads, head_dim)), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        k, rotated(k_ref.view(num_tokens, num_kv_heads, head_dim)), rtol=1e-6, atol=1e-6
    )
    assert torch.equal(v, v_ref.view(num_tokens, num_kv_heads, head_dim))
    assert torch.equal(cache[0][:, slots].transpose(0, 1), k)
    assert torch.equal(cache[1][:, slots].transpose(0, 1), v)
