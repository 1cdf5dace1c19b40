"""Sample and prompt logprobs against Hugging Face transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HF_TOLERANCE, IS_BF16_MODE, PROMPTS, free_blocks_are_all, hf_logprobs

from coreserve import LLM, SamplingParams

TOL = HF_TOLERANCE  # 1e-4 with fp32 weights; conftest states the bf16 one


def ranks_agree(a: int, b: int) -> bool:
    """Equal, or (deep in the tail, where neighbours lie closer than float rounding: other batch shapes
    round GEMMs and attention differently) swapped with a neighbour. With bf16 weights the kernels round
    each product's activations to bf16, so another batch shape moves a tail logprob by ~0.01 (measured
    0.013 at -23.4), and its rank among the dense tail by up to 1%."""
    slack = max(2, min(a, b) // 100) if IS_BF16_MODE else 2
    return a == b or (abs(a - b) <= slack and min(a, b) > 1000)


def check_position(entry: dict, chosen: int, reference: torch.Tensor, tokenizer, k: int) -> None:
    """One position: chosen token first with its true rank, then HF's top-k in HF's order."""
    ids = list(entry)
    assert ids[0] == chosen
    assert len(entry) in (k, k + 1)
    chosen_lp = reference[chosen].item()
    assert entry[chosen].logprob == pytest.approx(chosen_lp, abs=TOL)
    low = int((reference > chosen_lp + TOL).sum()) + 1
    high = int((reference > chosen_lp - TOL).sum()) + 1
    assert low <= entry[chosen].rank <= high
    top = reference.topk(k)
    engine_top = [t for t in ids if entry[t].rank <= k]
    for place, (hf_value, hf_id) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        if hf_id in entry:
            assert entry[hf_id].logprob == pytest.approx(hf_value, abs=TOL)
            if hf_id != chosen:
                assert (
                    entry[hf_id].rank == place
                    or abs(reference[hf_id] - top.values[entry[hf_id].rank - 1]) < TOL
                )
        else:  # only a tie at the boundary may swap which token is listed
            assert any(abs(entry[t].logprob - hf_value) < TOL for t in engine_top), (place, hf_id)
    for token_id, logprob in entry.items():
        assert logprob.logprob == pytest.approx(reference[token_id].item(), abs=TOL)
        assert logprob.decoded_token.encode("utf-8", "surrogateescape") == tokenizer.decode(
            [token_id]
        ).encode() or "\ufffd" in tokenizer.decode([token_id])


@pytest.fixture(scope="module")
def llm_chunked(tiny_path):
    """Tiny chunks and a tight cache: prompt logprobs must survive chunking and preemption."""
    with LLM(tiny_path, multiprocess=False, max_num_batched_tokens=8, num_kv_blocks=24, block_size=8) as llm:
        yield llm


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_logprobs_match_hf(llm_inproc, hf_tiny, tokenizer, temperature):
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=10, logprobs=5, ignore_eos=True)
    outputs = llm_inproc.generate(PROMPTS[:6], params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 10
        reference = hf_logprobs(hf_tiny, output.prompt_token_ids + completion.token_ids)
        for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_position(
                entry, token_id, reference[len(output.prompt_token_ids) - 1 + step].float(), tokenizer, 5
            )
        chosen = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        assert completion.cumulative_logprob == pytest.approx(math.fsum(chosen), abs=1e-4)


def test_prompt_logprobs_match_hf_through_chunks_and_preemption(llm_chunked, hf_tiny, tokenizer):
    params = SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=4, ignore_eos=True)
    outputs = llm_chunked.generate(PROMPTS[:8], params, use_tqdm=False)
    assert llm_chunked.get_engine_stats().num_preemptions > 0
    assert free_blocks_are_all(llm_chunked)
    for output in outputs:
        prompt = output.prompt_token_ids
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        reference = hf_logprobs(hf_tiny, prompt)
        for i in range(1, len(prompt)):
            check_position(output.prompt_logprobs[i], prompt[i], reference[i - 1].float(), tokenizer, 4)


def test_prompt_logprobs_do_not_depend_on_chunking_or_batch(llm_inproc, llm_chunked):
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    alone = llm_inproc.generate(PROMPTS[12], params, use_tqdm=False)[0].prompt_logprobs
    chunked = llm_chunked.generate([PROMPTS[0], PROMPTS[12]], params, use_tqdm=False)[1].prompt_logprobs
    assert len(alone) == len(chunked)
    for a, b in zip(alone[1:], chunked[1:]):
        assert list(a) == list(b)
        for x, y in zip(a.values(), b.values()):
            assert ranks_agree(x.rank, y.rank)
        assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=TOL)


def test_no_logprobs_means_none_and_zero_means_one_entry(llm_inproc):
    none, zero = llm_inproc.generate(
        [PROMPTS[0], PROMPTS[0]],
        [
            SamplingParams(temperature=0.0, max_tokens=5),
            SamplingParams(temperature=0.0, max_tokens=5, logprobs=0),
        ],
        use_tqdm=False,
    )
    assert none.outputs[0].logprobs is None and none.outputs[0].cumulative_logprob is None
    assert none.prompt_logprobs is None
    assert [len(d) for d in zero.outputs[0].logprobs] == [1] * 5
    assert [next(iter(d)) for d in zero.outputs[0].logprobs] == zero.outputs[0].token_ids


def test_processed_mode_is_log_softmax_of_scaled_logits_over_survivors(llm_inproc, hf_tiny):
    params = SamplingParams(
        temperature=0.5, top_k=10, top_p=0.9, seed=2, max_tokens=6, logprobs=5, logprobs_mode="processed"
    )
    output = llm_inproc.generate(PROMPTS[3], params, use_tqdm=False)[0]
    completion = output.outputs[0]
    tokens = output.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        logits = hf_tiny(torch.tensor([tokens])).logits[0].double() / 0.5
    for step, entry in enumerate(completion.logprobs):
        reference = survivors_log_softmax(
            logits[len(output.prompt_token_ids) - 1 + step], top_k=10, top_p=0.9
        )
        assert completion.token_ids[step] in entry
        for token_id, logprob in entry.items():
            expected = reference[token_id].item()
            if math.isinf(expected):
                assert math.isinf(logprob.logprob)
            else:
                assert logprob.logprob == pytest.approx(expected, abs=TOL)


def survivors_log_softmax(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    kept = torch.full_like(logits, float("-inf"))
    top = logits.topk(top_k)
    kept[top.indices] = top.values
    probs = torch.softmax(top.values, dim=-1)
    mass_before = probs.cumsum(0) - probs
    drop = top.indices[mass_before > top_p]
    kept[drop] = float("-inf")
    return torch.log_softmax(kept, dim=-1)


def test_raw_mode_ignores_temperature(llm_inproc, hf_tiny):
    params = SamplingParams(temperature=0.5, top_k=10, seed=8, max_tokens=4, logprobs=2)
    output = llm_inproc.generate(PROMPTS[4], params, use_tqdm=False)[0]
    reference = hf_logprobs(hf_tiny, output.prompt_token_ids + output.outputs[0].token_ids)
    for step, token_id in enumerate(output.outputs[0].token_ids):
        expected = reference[len(output.prompt_token_ids) - 1 + step][token_id].item()
        assert output.outputs[0].logprobs[step][token_id].logprob == pytest.approx(expected, abs=TOL)


def test_whole_vocabulary_when_max_logprobs_allows(tiny_path, hf_tiny):
    with LLM(tiny_path, multiprocess=False, max_logprobs=-1, num_kv_blocks=32) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
        output = llm.generate("Hello there", params, use_tqdm=False)[0]
    vocab = hf_tiny.config.vocab_size
    assert [len(d) for d in output.outputs[0].logprobs] == [vocab, vocab]
    assert all(len(d) == vocab for d in output.prompt_logprobs[1:])
    total = math.fsum(math.exp(x.logprob) for x in output.outputs[0].logprobs[0].values())
    assert total == pytest.approx(1.0, abs=1e-4)


@pytest.mark.fp32_exact(
    "with bf16 weights the torch path (the CUDA one) runs bf16 activations and the C kernels fp32 ones: "
    "they differ by design, by more than a token's margin; each is checked against HF on its own"
)
def test_torch_paths_match_the_cpu_kernels(llm_inproc, tiny_path):
    """can_use_cpu_kernels=False runs torch's ops only (the CUDA path): same tokens, same logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    with LLM(
        tiny_path,
        multiprocess=False,
        max_num_batched_tokens=256,
        num_kv_blocks=512,
        can_use_cpu_kernels=False,
    ) as llm_torch:
        assert llm_torch.client.core.executor.backend.name == "torch"
        assert llm_inproc.client.core.executor.backend.name == "cpu"
        torch_outputs = llm_torch.generate(PROMPTS[:8], params, use_tqdm=False)
    kernel_outputs = llm_inproc.generate(PROMPTS[:8], params, use_tqdm=False)
    for ours, theirs in zip(kernel_outputs, torch_outputs):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        positions = list(zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs))
        positions += list(zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]))
        for a, b in positions:
            assert list(a) == list(b)  # the chosen token, then the same top-k in the same order
            for token_id in a:
                assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=TOL)
                assert ranks_agree(a[token_id].rank, b[token_id].rank)


def test_logprob_objects_behave_like_vllms_and_stay_out_of_the_cyclic_gc(llm_inproc):
    """vLLM's dataclass API (positional or keyword, defaults, equality, repr, pickling), and untracked by
    the collector: tracked, the ~100,000 of them in a long logprobs=5 batch made collections the
    frontend's largest cost."""
    import gc
    import pickle

    from coreserve import Logprob

    entry = Logprob(-0.25, 1, "a")
    assert entry == Logprob(logprob=-0.25, rank=1, decoded_token="a")
    assert Logprob(-1.0) == Logprob(-1.0, None, None)
    assert repr(entry) == "Logprob(logprob=-0.25, rank=1, decoded_token='a')"
    assert pickle.loads(pickle.dumps(entry)) == entry
    entry.rank = 2  # mutable, as vLLM's
    assert entry.rank == 2
    outputs = llm_inproc.generate(["Hello, my name is"], SamplingParams(max_tokens=4, logprobs=3))
    for position in outputs[0].outputs[0].logprobs:
        assert all(type(v) is Logprob and not gc.is_tracked(v) for v in position.values())


def test_cumulative_logprob_has_the_same_bits_one_token_or_a_window_at_a_time():
    """A multi-step output carries N tokens; its sum must be N = 1's, which adds one value at a time."""
    import numpy as np

    from coreserve.frontend.engine.logprob_rows import add_chosen
    from coreserve.protocol.arrays import LogprobsArrays

    # 24 positions from near-certain (-1e-9) to unlikely (-30): float32 values whose float64 partial
    # sums round, so grouping them by window (a numpy sum per output, say) would change the bits.
    chosen = (-(10.0 ** np.random.default_rng(0).uniform(-9, 1.5, 24))).astype(np.float32)
    values = np.repeat(chosen[:, None], 3, axis=1)
    ids = np.zeros((24, 3), dtype=np.int32)
    ranks = np.ones(24, dtype=np.int32)
    one_at_a_time = 0.0
    for row in range(24):
        one_at_a_time = add_chosen(
            one_at_a_time,
            LogprobsArrays.from_numpy(ids[row : row + 1], values[row : row + 1], ranks[row : row + 1]),
            1,
        )
    windows = 0.0
    for start in range(0, 24, 8):
        part = slice(start, start + 8)
        windows = add_chosen(windows, LogprobsArrays.from_numpy(ids[part], values[part], ranks[part]), 8)
    assert windows == one_at_a_time  # exact, not approximately
    trimmed = add_chosen(0.0, LogprobsArrays.from_numpy(ids[:8], values[:8], ranks[:8]), 5)  # a stop at 5
    assert trimmed == add_chosen(0.0, LogprobsArrays.from_numpy(ids[:5], values[:5], ranks[:5]), 5)


def test_each_prompt_logprobs_slice_reports_progress(tiny_path):
    """A step's prompt-logprobs slices (PROMPT_LOGITS_SLICE_ROWS rows of lm_head each) pass no layer: each
    reports progress, so a long scoring step over a large vocabulary is not taken for a hung core."""
    from coreserve.worker.sampling.prompt_logprobs import PROMPT_LOGITS_SLICE_ROWS

    length = 2 * PROMPT_LOGITS_SLICE_ROWS + 88  # one step, three slices
    prompts = [{"prompt_token_ids": [(37 * i + seed) % 1000 + 10 for i in range(length)]} for seed in (1, 2)]
    with LLM(tiny_path, multiprocess=False, max_num_batched_tokens=1024, num_kv_blocks=128) as llm:
        reports = []
        llm.client.core.executor.on_progress = lambda: reports.append(1)
        llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
        plain = len(reports)
        llm.generate(prompts[1:], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert len(reports) - plain == plain + 3
