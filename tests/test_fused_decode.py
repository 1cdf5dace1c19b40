"""The fused decode forward (coreserve/worker/cpu/fused_decode.py, coreserve/worker/cpu/csrc/decode_forward.c) against the op-by-op path
of the same model on the same paged cache: bit for bit, for every family's features (q/k/v and o
biases, sliding window, tied embeddings, Qwen3's per-head q/k norms, SmolLM3's NoPE layers), fp32 and bf16
weights, with and without the bf16 dot instruction, one row and many; and its lm_head products equal
compute_logits' on the same hidden states."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from coreserve.protocol.sampling_params import SamplingParams
from coreserve.worker.cpu.attention_plan import cpu_attention_plan
from coreserve.worker.cpu.fused_decode import FUSED_MAX_ROWS, FusedForward
from coreserve.worker.cpu.kernels import load_cpu_kernels
from coreserve.worker.cpu.ops import CpuOps, apply_cpu_backend
from coreserve.worker.models.loader import load_model
from coreserve.worker.step.input_batch import RequestState, build_step_inputs

BLOCK_SIZE = 8
# llama3.1 carries q/k/v and o biases, mistral a window of 24 (the prompts cross it), qwen2 q/k/v
# biases and tied embeddings, qwen3 per-head q/k norms, smollm3 a layer without RoPE
FAMILIES = ["llama3.1", "mistral", "qwen2", "qwen3", "smollm3"]


@pytest.fixture(scope="module")
def kernels():
    loaded = load_cpu_kernels()
    assert loaded is not None, "this machine has a C compiler: the kernels must build"
    return loaded


def decode_states(num_rows: int, prompt_len: int) -> list[RequestState]:
    """Requests with their prompts computed, each on its own scattered blocks, ready for decode."""
    states = []
    for i in range(num_rows):
        num_tokens = prompt_len + 3 * i
        blocks = [(7 * i + 5 * b) % 97 + 100 * i for b in range(num_tokens // BLOCK_SIZE + 4)]
        token_ids = [(31 * i + 17 * t) % 1000 + 5 for t in range(num_tokens)]
        states.append(
            RequestState(str(i), token_ids, num_tokens, SamplingParams(), blocks, 0, None, None, False, [])
        )
    return states


def step_inputs(states, num_tokens: list[int], device):
    """The step's inputs with the CPU backend's attention plan, as the runner prepares them."""
    inputs = build_step_inputs(states, num_tokens, BLOCK_SIZE, device)
    inputs.attn.plan = cpu_attention_plan(inputs.attn, False, BLOCK_SIZE)
    return inputs


def run_steps(model, kernels, states, caches, num_steps: int, fuse: bool) -> list[torch.Tensor]:
    """Prefill (op by op), then `num_steps` decode steps fused or op by op, as the runner chooses; the
    decode steps' hidden states. Checks that the fused forward applies exactly where it is to."""
    fused, device, hidden = FusedForward(kernels, model.weights(), caches, model.args), torch.device("cpu"), []
    for state in states:
        state.num_computed_tokens = 0
        del state.token_ids[state.num_prompt_tokens :]
    with torch.inference_mode():
        inputs = step_inputs(states, [s.num_prompt_tokens for s in states], device)
        assert fused.step(inputs) is None  # prefill: op by op
        model(inputs.input_ids, inputs.positions, caches, inputs.attn)
        for step in range(num_steps + 1):
            for state in states:
                state.num_computed_tokens = len(state.token_ids)
                state.token_ids.append((13 * step + len(state.token_ids)) % 1000 + 5)
            if step == num_steps:
                break
            inputs = step_inputs(states, [1] * len(states), device)
            fused_step = fused.step(inputs, with_logits=True)
            assert (fused_step is not None) == (len(states) <= FUSED_MAX_ROWS)
            if fuse and fused_step is not None:
                hidden.append(fused.run(fused_step))
                # lm_head in the same region: compute_logits' numbers on the same hidden states
                assert fused_step.logits is not None
                assert torch.equal(fused_step.logits, model.compute_logits(hidden[-1]))
            else:
                hidden.append(model(inputs.input_ids, inputs.positions, caches, inputs.attn))
    return hidden


def model_and_caches(path: str, dtype: torch.dtype, kernels):
    model = load_model(path, dtype, torch.device("cpu"))
    apply_cpu_backend(model, kernels)
    a = model.args
    caches = [torch.zeros(2, a.num_kv_heads, 1600 * BLOCK_SIZE, a.head_dim) for _ in range(a.num_layers)]
    return model, caches


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, FUSED_MAX_ROWS])
def test_fused_forward_equals_the_op_by_op_path(kernels, family_model, family, dtype, num_rows):
    model, caches = model_and_caches(family_model(family), dtype, kernels)
    states = decode_states(num_rows, prompt_len=21)  # 21 + 3 steps crosses mistral's window of 24
    fused = run_steps(model, kernels, states, caches, num_steps=4, fuse=True)
    op_by_op = run_steps(model, kernels, states, caches, num_steps=4, fuse=False)
    for got, expected in zip(fused, op_by_op, strict=True):
        assert torch.equal(got, expected)  # Qwen3's q/k norms too: the same C norm on both paths


def test_past_the_fused_row_count_the_op_by_op_path_runs(kernels, family_model):
    model, caches = model_and_caches(family_model("llama3.1"), torch.float32, kernels)
    states = decode_states(FUSED_MAX_ROWS + 1, prompt_len=9)
    run_steps(model, kernels, states, caches, num_steps=1, fuse=True)  # asserts the fused one never applies


def test_bf16_fallback_without_the_dot_instruction_agrees_too(kernels, family_model):
    """The bf16 widening path (CPUs without AVX512-BF16) inside the fused forward, forced."""
    widening = dataclasses.replace(kernels, has_bf16_dot=False)
    model, caches = model_and_caches(family_model("qwen2"), torch.bfloat16, widening)
    states = decode_states(2, prompt_len=12)
    fused = run_steps(model, widening, states, caches, num_steps=2, fuse=True)
    op_by_op = run_steps(model, widening, states, caches, num_steps=2, fuse=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, op_by_op, strict=True))
    if kernels.has_bf16_dot:  # and the dot instruction gives other sums: the fallback really ran
        model.ops = CpuOps(kernels)
        with_dot = run_steps(model, kernels, states, caches, num_steps=2, fuse=True)
        assert not all(torch.equal(a, b) for a, b in zip(with_dot, fused))


def test_a_strided_column_of_sampled_tokens_is_read_as_its_values(kernels, tiny_path):
    """A multi-step window feeds back `top.ids[:, 0]`, a strided view, as the next input ids."""
    model, caches = model_and_caches(tiny_path, torch.float32, kernels)
    states = decode_states(3, prompt_len=10)
    run_steps(model, kernels, states, caches, num_steps=1, fuse=True)
    inputs = step_inputs(states, [1] * 3, torch.device("cpu"))
    strided = torch.stack([inputs.input_ids, torch.zeros_like(inputs.input_ids)], dim=1)[:, 0]
    assert not strided.is_contiguous()
    fused = FusedForward(kernels, model.weights(), caches, model.args)
    with torch.inference_mode():
        expected = fused.run(fused.step(inputs))
        got = fused.run(fused.step(dataclasses.replace(inputs, input_ids=strided)))
    assert torch.equal(got, expected)
