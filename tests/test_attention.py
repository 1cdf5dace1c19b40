"""The CPU kernels (decode attention, fused layer steps) against the torch paths, on the same paged cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from coreserve.protocol.sampling_params import SamplingParams
from coreserve.worker.backend import TorchBackend
from coreserve.worker.cpu.backend import CpuBackend
from coreserve.worker.cpu.kernels import load_cpu_kernels
from coreserve.worker.cpu.ops import CpuOps
from coreserve.worker.models.loader import load_model
from coreserve.worker.models.ops import TorchOps
from coreserve.worker.step.attention import AttentionSpec
from coreserve.worker.step.input_batch import RequestState, build_step_inputs

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels()
    assert loaded is not None, "this machine has a C compiler: the kernels must build"
    return loaded


def ops_of(kernels):
    """The C kernels' ops, or torch's (None: no compiler needed)."""
    return TorchOps() if kernels is None else CpuOps(kernels)


def planned(attn, kernels, is_batch_invariant: bool = False):
    """A copy of `attn` with the plan its backend's prepare() makes before a forward (kernels None:
    torch's)."""
    if kernels is None:
        backend = TorchBackend(torch.device("cpu"))
    else:
        backend = CpuBackend(kernels, is_batch_invariant, BLOCK_SIZE, can_fuse=False)
    copy = dataclasses.replace(attn)
    backend.prepare(copy)
    return copy


def make_state(req_id: str, num_tokens: int, block_ids: list[int], num_computed: int) -> RequestState:
    return RequestState(
        req_id, list(range(num_tokens)), num_tokens, SamplingParams(), block_ids, num_computed,
        None, None, False, [],
    )


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

    inputs = build_step_inputs(states, num_tokens, BLOCK_SIZE, torch.device("cpu"))
    assert inputs.attn.decode is not None and len(inputs.attn.decode.rows) == 4
    assert len(inputs.attn.seqs) == 2  # the 12-token chunk and the 1-token prompt
    slots = inputs.attn.slot_mapping  # this step's K and V, as the layer has just written them
    k, v = cache[0][:, slots].transpose(0, 1), cache[1][:, slots].transpose(0, 1)
    expected = reference_attention(q, cache, states, num_tokens)
    kernel = CpuOps(kernels).attention(q, k, v, cache, planned(inputs.attn, kernels), AttentionSpec())
    torch_path = TorchOps().attention(q, k, v, cache, planned(inputs.attn, None), AttentionSpec())
    for actual in (kernel, torch_path):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def reference_attention(q, cache, states, num_tokens) -> torch.Tensor:
    """Each query row attends to its own positions 0..position, looked up slot by slot in float64."""
    group = q.shape[1] // cache.shape[1]
    rows = []
    for state, num in zip(states, num_tokens):
        for position in range(state.num_computed_tokens, state.num_computed_tokens + num):
            slots = [
                state.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(position + 1)
            ]
            keys = cache[0][:, slots].double().repeat_interleave(group, dim=0)  # [Hq, L, D]
            values = cache[1][:, slots].double().repeat_interleave(group, dim=0)
            query = q[len(rows)].double()[:, None, :] * q.shape[2] ** -0.5  # [Hq, 1, D]
            weights = (query @ keys.transpose(1, 2)).softmax(dim=-1)
            rows.append((weights @ values)[:, 0])
    return torch.stack(rows).float()


@pytest.mark.parametrize("head_dim", [4, 8, 12, 40, 64, 72, 128])
def test_kernel_matches_float64_reference_at_every_head_width(kernels, head_dim):
    """Head widths past and short of the kernel's 32- and 8-column value loops, and one not a multiple
    of 8 (the plain loop); contexts across block ends, grouped queries."""
    generator = np.random.default_rng(head_dim)
    free_blocks = generator.permutation(64).tolist()
    states = []
    for context in (1, 7, 8, 9, 61, 140):
        blocks = [free_blocks.pop() for _ in range(-(-context // BLOCK_SIZE))]
        states.append(make_state(str(len(states)), context, blocks, context - 1))
    cache = torch.randn(2, 2, 64 * BLOCK_SIZE, head_dim)
    q = torch.randn(len(states), 6, head_dim)
    inputs = build_step_inputs(states, [1] * len(states), BLOCK_SIZE, torch.device("cpu"))
    slots = inputs.attn.slot_mapping  # the 1-token prompt attends to its own k and v, as written
    k, v = cache[0][:, slots].transpose(0, 1), cache[1][:, slots].transpose(0, 1)
    actual = CpuOps(kernels).attention(q, k, v, cache, planned(inputs.attn, kernels), AttentionSpec())
    expected = reference_attention(q, cache, states, [1] * len(states))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_decode_attends_exactly_the_context_length(request, path):
    """Slots past the context (reserved for later steps, or padding up to a longer row's context) hold
    garbage that must not be read."""
    cache = torch.randn(2, 2, 64 * BLOCK_SIZE, 16)
    short = make_state("r", 13, [5, 9, 2], 12)  # block 2 reserved ahead, positions 13.. unused
    long = make_state("s", 40, [20, 21, 22, 23, 24], 39)  # pads the short row's gather to 40 slots
    q = torch.randn(2, 4, 16)
    kv = torch.zeros(2, 2, 16)
    kernels = request.getfixturevalue("kernels") if path == "kernel" else None  # torch: no compiler needed
    inputs = build_step_inputs([short, long], [1, 1], BLOCK_SIZE, torch.device("cpu"))
    ops = ops_of(kernels)
    before = ops.attention(q, kv, kv, cache, planned(inputs.attn, kernels), AttentionSpec())
    cache[:, :, 9 * BLOCK_SIZE + 5 : 20 * BLOCK_SIZE] = float("nan")  # past position 12, in block 9, ...
    cache[:, :, 2 * BLOCK_SIZE : 3 * BLOCK_SIZE] = float("nan")
    cache[:, :, 0:BLOCK_SIZE] = float("nan")  # block 0: where the padding of a short row's table points
    again = ops.attention(q, kv, kv, cache, planned(inputs.attn, kernels), AttentionSpec())
    torch.testing.assert_close(again, before)
    assert torch.isfinite(before).all()
    torch.testing.assert_close(
        before, reference_attention(q, cache, [short, long], [1, 1]), rtol=1e-5, atol=1e-5
    )


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
            inputs = build_step_inputs([state], [num], BLOCK_SIZE, torch.device("cpu"))
            model.ops = ops_of(which)
            with torch.inference_mode():
                attn = planned(inputs.attn, which)
                outputs.append(model(inputs.input_ids, inputs.positions, caches, attn))
            state.num_computed_tokens += num
        hidden[name] = torch.cat(outputs)
    torch.testing.assert_close(hidden["kernels"], hidden["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window, has_sinks", [(11, False), (8, False), (8, True), (None, True)])
def test_sliding_window_in_the_kernel_the_torch_decode_and_prefill_chunks(kernels, window, has_sinks):
    """Mistral's window: each row attends to itself and the window - 1 positions before it, whether
    its window starts mid-block or on a block edge, in decode rows (kernel and torch), chunks with
    context (one whose window leaves its first blocks behind), and a first chunk longer than the window;
    gpt-oss's sinks (a logit a head in each softmax's denominator) on the same paths, windowed or not."""
    generator = np.random.default_rng(window)
    free_blocks = generator.permutation(200).tolist()
    states, num_tokens = [], []
    for context, scheduled in [(37, 1), (3, 1), (20, 12), (130, 1), (30, 30), (64, 1), (60, 9)]:
        blocks = [free_blocks.pop() for _ in range(-(-context // BLOCK_SIZE))]
        states.append(make_state(str(len(states)), context, blocks, context - scheduled))
        num_tokens.append(scheduled)
    cache = torch.randn(2, 2, 200 * BLOCK_SIZE, 32)
    q = torch.randn(sum(num_tokens), 6, 32)
    sinks = 2.0 * torch.randn(6) if has_sinks else None  # beside scores of a few units: a share of each softmax
    expected = _windowed_reference(q, cache, states, num_tokens, window, sinks)
    for kernel in (kernels, None):
        inputs = build_step_inputs(states, num_tokens, BLOCK_SIZE, torch.device("cpu"))
        slots = inputs.attn.slot_mapping
        k, v = cache[0][:, slots].transpose(0, 1), cache[1][:, slots].transpose(0, 1)
        attn = planned(inputs.attn, kernel)
        actual = ops_of(kernel).attention(q, k, v, cache, attn, AttentionSpec(window), sinks)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _windowed_reference(q, cache, states, num_tokens, window: int | None, sinks=None) -> torch.Tensor:
    """In float64; sinks [Hq]: a last column of each row's scores, dropped after the softmax (HF's gpt-oss)."""
    group, rows = q.shape[1] // cache.shape[1], []
    for state, num in zip(states, num_tokens):
        for position in range(state.num_computed_tokens, state.num_computed_tokens + num):
            positions = range(0 if window is None else max(0, position - window + 1), position + 1)
            slots = [state.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
            keys = cache[0][:, slots].double().repeat_interleave(group, dim=0)
            values = cache[1][:, slots].double().repeat_interleave(group, dim=0)
            query = q[len(rows)].double()[:, None, :] * q.shape[2] ** -0.5
            scores = query @ keys.transpose(1, 2)  # [Hq, 1, L]
            if sinks is not None:
                scores = torch.cat((scores, sinks.double()[:, None, None]), dim=-1)
            weights = scores.softmax(dim=-1)[..., : len(slots)]
            rows.append((weights @ values)[:, 0])
    return torch.stack(rows).float()


@pytest.mark.parametrize("window", [None, 11])
def test_batch_invariant_prefill_attends_each_token_as_its_decode_step_would(kernels, window):
    """With batch invariance every token goes through the decode kernel over its own causal prefix: a
    chunk's token at position p gets the bits p's decode step gets alone, in any mixed batch."""
    generator = np.random.default_rng(3)
    free_blocks = generator.permutation(200).tolist()
    states, num_tokens = [], []
    for context, scheduled in [(37, 1), (20, 12), (1, 1), (130, 1), (30, 30), (60, 9)]:
        blocks = [free_blocks.pop() for _ in range(-(-context // BLOCK_SIZE))]
        states.append(make_state(str(len(states)), context, blocks, context - scheduled))
        num_tokens.append(scheduled)
    cache = torch.randn(2, 2, 200 * BLOCK_SIZE, 32)
    q = torch.randn(sum(num_tokens), 6, 32)
    ops = CpuOps(kernels, is_batch_invariant=True)
    inputs = build_step_inputs(states, num_tokens, BLOCK_SIZE, torch.device("cpu"))
    slots = inputs.attn.slot_mapping
    k, v = cache[0][:, slots].transpose(0, 1), cache[1][:, slots].transpose(0, 1)
    batched = ops.attention(q, k, v, cache, planned(inputs.attn, kernels, True), AttentionSpec(window))
    row = 0
    for state, num in zip(states, num_tokens):
        for position in range(state.num_computed_tokens, state.num_computed_tokens + num):
            one = make_state("one", position + 1, state.block_ids, position)
            alone = build_step_inputs([one], [1], BLOCK_SIZE, torch.device("cpu"))
            q_row = q[row : row + 1].contiguous()
            attn = planned(alone.attn, kernels, True)
            got = ops.attention(q_row, k[row : row + 1], v[row : row + 1], cache, attn, AttentionSpec(window))
            assert torch.equal(got[0], batched[row]), (state.req_id, position)
            row += 1
    if window is None:
        torch.testing.assert_close(
            batched, reference_attention(q, cache, states, num_tokens), rtol=1e-5, atol=1e-5
        )
