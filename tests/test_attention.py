"""The CPU kernels (decode attention, fused layer steps) against the torch paths, on the same paged cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.sampling_params import SamplingParams
from worker.attention import paged_attention
from worker.cpu_kernels import load_cpu_kernels
from worker.input_batch import RequestState, build_step_inputs
from worker.models.loader import load_model

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels()
    assert loaded is not None, "this machine has a C compiler: the kernels must build"
    return loaded


def make_state(req_id: str, num_tokens: int, block_ids: list[int], num_computed: int) -> RequestState:
    return RequestState(
        req_id, list(range(num_tokens)), num_tokens, SamplingParams(), block_ids, num_computed,
        None, None, False, [],
    )  # fmt: skip


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(8, 2), (4, 4), (6, 3)])
def test_kernel_matches_torch_path_on_fragmented_blocks_in_a_mixed_batch(kernels, num_q_heads, num_kv_heads):
    generator = np.random.default_rng(num_q_heads)
    free_blocks = generator.permutation(200).tolist()  # shuffled: requests' blocks are not adjacent
    states, num_tokens = [], []
    for context, scheduled in [(37, 1), (1, 1), (20, 12), (130, 1), (9, 1), (64, 1)]:
        num_blocks = -(-context // BLOCK_SIZE)
        blocks = [free_blocks.pop() for _ in range(num_blocks)]
        states.append(make_state(str(len(states)), context, blocks, context - scheduled))
        num_tokens.append(scheduled)
    cache = torch.randn(2, num_kv_heads, 200 * BLOCK_SIZE, 32)
    num_rows = sum(num_tokens)
    q = torch.randn(num_rows, num_q_heads, 32)
    unused_kv = torch.zeros(num_rows, num_kv_heads, 32)  # already in the cache: the paths read it there

    with_kernel = build_step_inputs(states, num_tokens, BLOCK_SIZE, torch.device("cpu"), kernels)
    torch_only = build_step_inputs(states, num_tokens, BLOCK_SIZE, torch.device("cpu"))
    assert with_kernel.attn.decode is not None and len(with_kernel.attn.decode.rows) == 4
    assert torch_only.attn.decode is None
    assert torch.equal(with_kernel.attn.slot_mapping, torch_only.attn.slot_mapping)
    expected = paged_attention(q, unused_kv, unused_kv, cache, torch_only.attn)
    actual = paged_attention(q, unused_kv, unused_kv, cache, with_kernel.attn)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_kernel_attends_exactly_the_context_length(kernels):
    """Slots past the context (reserved for later steps) hold garbage that must not be read."""
    cache = torch.randn(2, 2, 64 * BLOCK_SIZE, 16)
    state = make_state("r", 13, [5, 9, 2], 12)  # block 2 reserved ahead, positions 13.. unused
    q = torch.randn(1, 4, 16)
    kv = torch.zeros(1, 2, 16)
    inputs = build_step_inputs([state], [1], BLOCK_SIZE, torch.device("cpu"), kernels)
    before = paged_attention(q, kv, kv, cache, inputs.attn)
    cache[:, :, 9 * BLOCK_SIZE + 5 :] = float("nan")  # past position 12, in block 9, and everything after
    cache[:, :, 2 * BLOCK_SIZE : 3 * BLOCK_SIZE] = float("nan")
    torch.testing.assert_close(paged_attention(q, kv, kv, cache, inputs.attn), before)
    assert torch.isfinite(before).all()


def test_model_forward_with_kernels_matches_torch_paths(kernels, tiny_path):
    """Prefill then two decode steps of the built-in model, once through the CPU kernels (fused RoPE and
    cache write, SiLU-and-multiply, decode attention) and once through the torch paths."""
    model = load_model(tiny_path, torch.float32, torch.device("cpu"))
    a = model.args
    hidden = {}
    for name, which in (("kernels", kernels), ("torch", None)):
        caches = [torch.zeros(2, a.num_kv_heads, 8 * BLOCK_SIZE, a.head_dim) for _ in range(a.num_layers)]
        state = make_state("r", 22, [3, 0, 6, 1], 0)  # out of order: the slot arithmetic is exercised
        outputs = []
        for num in (20, 1, 1):  # the prompt's first 20 tokens, then one token at a time
            inputs = build_step_inputs([state], [num], BLOCK_SIZE, torch.device("cpu"), which)
            with torch.inference_mode():
                outputs.append(model(inputs.input_ids, inputs.positions, caches, inputs.attn))
            state.num_computed_tokens += num
        hidden[name] = torch.cat(outputs)
    torch.testing.assert_close(hidden["kernels"], hidden["torch"], rtol=1e-4, atol=1e-4)
