"""Hidden states (return_hidden_states, docs/logprobs.md "Hidden states"), on the built-in tiny model: HF's
output_hidden_states within 1e-4 at every index; the same bits alone and in batches of 1 to 32 prompts of
mixed lengths, under chunked prefill at two chunk sizes, preempted and recomputed, in multi-step windows,
with a warm prefix cache, through the fused decode step or op by op; the final norm's output times lm_head, in the engine's
own product, gives the engine's logits exactly; what the engine cannot return is refused by name. The
server's shape is tested in tests/test_server_chat.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import load_hf
from test_batch_invariance import random_prompts, sampled_rows

from coreserve import LLM, SamplingParams

NUM_LAYERS = 4  # the tiny model's decoder layers: HF's indices 0..4
EVERY_INDEX = list(range(NUM_LAYERS + 1))
ASKED = SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True, logprobs=2,
                       return_hidden_states=[0, 2, -1])


def states(output) -> np.ndarray:
    return output.outputs[0].hidden_states


@pytest.fixture(scope="module")
def llm(tiny_path):
    """Steps of at most 16 tokens: every prompt past 16 prefills in chunks."""
    with LLM(tiny_path, multiprocess=False, max_num_batched_tokens=16, num_kv_blocks=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm) -> list[np.ndarray]:
    """32 prompts of 1 to 60 tokens, all in one call."""
    return [states(o) for o in llm.generate(random_prompts(32, 7), ASKED, use_tqdm=False)]


@pytest.mark.fp32_exact("HF's bf16 forward rounds each layer to bf16; the engine's activations stay fp32")
def test_every_index_and_position_is_hfs_output_hidden_states_within_1e_4(llm, tiny_path):
    prompt = random_prompts(1, 3, max_len=40)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_hidden_states=EVERY_INDEX)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    sequence = list(out.prompt_token_ids) + out.outputs[0].token_ids[:-1]  # every position computed
    with torch.no_grad():
        expected = load_hf(tiny_path)(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    got = states(out)
    assert got.dtype == np.float32 and got.shape == (NUM_LAYERS + 1, len(sequence), 256)
    for index in EVERY_INDEX:
        assert np.abs(got[index] - expected[index][0].numpy()).max() < 1e-4, index


def test_positions_prompt_and_output_are_the_all_rows_they_name(llm):
    prompt = random_prompts(1, 4, max_len=30)[0]
    num_prompt = len(prompt["prompt_token_ids"])
    whole = states(llm.generate([prompt], ASKED, use_tqdm=False)[0])
    parts = {which: states(llm.generate([prompt], _with(ASKED, hidden_states_positions=which), use_tqdm=False)[0])
             for which in ("prompt", "output")}
    assert whole.shape[1] == num_prompt + 8 - 1
    assert np.array_equal(parts["prompt"], whole[:, :num_prompt])
    assert np.array_equal(parts["output"], whole[:, num_prompt - 1 :])  # row j: the state that sampled token j


def test_batches_of_1_to_32_mixed_lengths_give_the_same_bits(llm, reference):
    prompts = random_prompts(32, 7)
    for size, start in ((1, 0), (1, 31), (3, 5), (8, 12), (17, 15)):
        batch = llm.generate(prompts[start : start + size], ASKED, use_tqdm=False)
        for offset, out in enumerate(batch):
            assert np.array_equal(states(out), reference[start + offset]), (size, start + offset)


def test_a_request_among_others_that_ask_nothing_or_other_layers_keeps_its_bits(llm, reference):
    """Steps where only the fused decode step runs (the final norm's alone asked), and where another
    request's layers make the step run op by op: the two paths give the same bits."""
    prompts = random_prompts(32, 7)
    plain = SamplingParams(max_tokens=5, temperature=0.9, seed=1)
    last_only = _with(ASKED, return_hidden_states=True)
    mixed = llm.generate(prompts[:6], [ASKED, plain, last_only, plain, ASKED, plain], use_tqdm=False)
    assert np.array_equal(states(mixed[0]), reference[0]) and np.array_equal(states(mixed[4]), reference[4])
    assert states(mixed[1]) is None
    assert np.array_equal(states(mixed[2])[0], reference[2][-1])
    fused = llm.generate([prompts[2]], last_only, use_tqdm=False)[0]  # decode steps in the fused C step
    assert np.array_equal(states(fused), states(mixed[2]))
    assert sampled_rows(fused) == sampled_rows(mixed[2])


def test_another_chunk_size_preemption_windows_and_a_warm_prefix_cache_give_the_same_bits(tiny_path, reference):
    prompts = random_prompts(32, 7)
    engine = dict(max_num_batched_tokens=64, num_kv_blocks=24, block_size=16, num_scheduler_steps=4)
    with LLM(tiny_path, multiprocess=False, **engine) as llm:
        outputs = llm.generate(prompts[:12], ASKED, use_tqdm=False)
        assert llm.get_engine_stats().num_preemptions > 0
        output_rows = _with(ASKED, hidden_states_positions="output")
        cold = llm.generate([prompts[31]], output_rows, use_tqdm=False)[0]
        warm = llm.generate([prompts[31]], output_rows, use_tqdm=False)[0]
    for out, expected in zip(outputs, reference):
        assert np.array_equal(states(out), expected)
    num_prompt = len(prompts[31]["prompt_token_ids"])
    assert warm.num_cached_tokens > 0
    assert np.array_equal(states(warm), states(cold))
    assert np.array_equal(states(warm), reference[31][:, num_prompt - 1 :])


@pytest.mark.fp32_exact("the identity is stated for an fp32 lm_head (docs/logprobs.md)")
def test_the_final_norm_output_times_lm_head_in_the_engines_product_is_its_logits(llm, tiny_path, kernels):
    from safetensors import safe_open

    from coreserve.worker.cpu.linear import linear

    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, logprobs=5, logprobs_mode="raw_logits",
                            return_hidden_states=True, hidden_states_positions="output")
    outputs = llm.generate(random_prompts(4, 9), params, use_tqdm=False)
    with safe_open(f"{tiny_path}/model.safetensors", "pt") as weights:
        lm_head = torch.nn.Linear(256, weights.get_slice("lm_head.weight").get_shape()[0], bias=False)
        lm_head.weight.data = weights.get_tensor("lm_head.weight")
    for out in outputs:
        rows = torch.from_numpy(states(out)[0].copy())  # [tokens, hidden], row j sampled token j
        logits = linear(lm_head, rows, kernels, is_batch_invariant=True).numpy()
        for j, entries in enumerate(out.outputs[0].logprobs):
            assert all(logits[j, token] == entry.logprob for token, entry in entries.items()), j


def test_what_cannot_be_returned_is_refused_by_name(llm):
    prompt = random_prompts(1, 1)[0]
    for asked, match in (([5], "index 5"), ([-6], "index -6"), ([4, -1], "twice")):
        with pytest.raises(ValueError, match="return_hidden_states"):
            llm.generate([prompt], _with(ASKED, return_hidden_states=asked), use_tqdm=False)
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], _with(ASKED, return_hidden_states=asked), use_tqdm=False)
    with pytest.raises(ValueError, match="distinct"):
        SamplingParams(return_hidden_states=[1, 1])


def test_the_rules_bound_the_bytes_and_name_an_engine_without_them():
    from coreserve.protocol.request_rules import RequestLimits, RequestRuleError, check_hidden_states

    big = RequestLimits(vocab_size=1000, max_model_len=2**20, max_logprobs=20, num_kv_blocks=2**16, block_size=16,
                        num_hidden_layers=80, hidden_size=8192)
    params = SamplingParams(max_tokens=4096, return_hidden_states=[-1, 40])  # 2 x 4096 x 8192 x 4: 256 MiB
    check_hidden_states(params, 1, big)
    with pytest.raises(RequestRuleError, match=r"return_hidden_states asks for up to 1342177280 bytes"):
        check_hidden_states(_with(params, max_tokens=20480), 1, big)
    check_hidden_states(_with(params, max_tokens=20480, hidden_states_positions="prompt"), 1, big)
    refusing = RequestLimits(vocab_size=1000, max_model_len=64, max_logprobs=20, num_kv_blocks=8, block_size=16,
                             hidden_states_refusal="not built under tensor parallelism")
    with pytest.raises(RequestRuleError, match="return_hidden_states is not available: not built under tensor"):
        check_hidden_states(params, 1, refusing)


def test_n_greater_than_1_gives_each_completion_its_rows(llm):
    prompt = {"prompt_token_ids": [random.Random(2).randrange(100, 20000) for _ in range(20)]}
    out = llm.generate([prompt], _with(ASKED, n=3), use_tqdm=False)[0]
    alone = llm.generate([prompt], ASKED, use_tqdm=False)[0]
    rows = [c.hidden_states for c in out.outputs]
    assert all(r.shape == (3, 20 + 8 - 1, 256) for r in rows)
    assert all(np.array_equal(r[:, :20], rows[0][:, :20]) for r in rows)  # the prompt's, each computed
    assert np.array_equal(rows[0], states(alone))  # seed + 0


def _with(params: SamplingParams, **fields) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **fields)
