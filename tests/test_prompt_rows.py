"""Prompt logprobs kept with the prefix cache (coreserve/engine_core/prompt_rows.py): a warm request computes only
its uncached positions and returns every position's rows equal, bit for bit, to a cold run's: the rows'
bookkeeping alone, then the engine on the built-in model and on SmolLM2 against the cache off."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPTS, TEST_DTYPE, free_blocks_are_all

from coreserve import LLM, SamplingParams
from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.prompt_rows import MAX_EDGES
from coreserve.protocol.arrays import LogprobsArrays
from coreserve.protocol.builtin_model import builtin_model_path

BLOCK = 4


def _rows(first: int, num: int, width: int = 3) -> LogprobsArrays:
    """Rows whose every value says which position made it."""
    pos = np.arange(first, first + num)
    ids = np.repeat(pos[:, None], width, axis=1).astype(np.int32)
    return LogprobsArrays.from_numpy(ids, -ids.astype(np.float32), pos.astype(np.int32))


def test_a_block_is_read_with_its_body_and_the_edge_for_the_next_token_only():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    prompt = list(range(100, 111))  # 11 tokens: rows for positions 0..9, two full blocks
    kv.allocate("a", 11)
    indexed = kv.cache_full_blocks("a", prompt, [], 11)
    assert [number for number, _ in indexed] == [0, 1]
    kv.prompt_rows.store(indexed, [_rows(0, 6), _rows(6, 4)], prompt, (2, None))  # two chunks
    assert kv.prompt_rows.num_blocks == 2
    assert kv.take_cached_prefix("b", prompt, 10, (2, None)) == 8
    rows = kv.prompt_rows.take(kv.blocks_of("b"), prompt, (2, None))
    assert rows.ranks_np().tolist() == list(range(8)) and rows.num_cols == 3
    # another flavour, or a prompt whose token 8 differs (block 1's last row targets it), reads less
    assert kv.take_cached_prefix("c", prompt, 10, (1, None)) == 0
    assert kv.take_cached_prefix("d", prompt, 10, (2, 0.5)) == 0
    assert kv.take_cached_prefix("e", prompt[:8] + [7, 7, 7], 10, (2, None)) == 4
    assert kv.take_cached_prefix("f", prompt[:8] + [7, 7, 7], 10) == 8  # no prompt logprobs: all
    kv.reset_prefix_cache()
    assert kv.prompt_rows.num_blocks == 0


def test_a_block_at_the_prompts_end_keeps_no_edge_and_generated_blocks_keep_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    prompt = list(range(8))  # rows for positions 0..6: block 1 has a body, no edge
    kv.allocate("a", 12)
    indexed = kv.cache_full_blocks("a", prompt, [50, 51, 52, 53], 12)
    kv.prompt_rows.store(indexed, [_rows(0, 7)], prompt, (2, None))
    assert kv.prompt_rows.num_blocks == 2  # blocks 0 and 1; block 2 holds generated tokens
    assert kv.take_cached_prefix("b", prompt + [9], 8, (2, None)) == 4


def test_edges_accumulate_and_evicted_blocks_forget_their_rows():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True)
    for i, nxt in enumerate(range(MAX_EDGES + 1)):
        prompt = [1, 2, 3, 4, 1000 + nxt, 0]
        kv.allocate(f"r{i}", 6)
        indexed = kv.cache_full_blocks(f"r{i}", prompt, [], 6)
        kv.prompt_rows.store(indexed, [_rows(0, 5)], prompt, (2, None))
        kv.free(f"r{i}")
    readable = [kv.take_cached_prefix(f"q{n}", [1, 2, 3, 4, 1000 + n], 4, (2, None)) for n in range(17)]
    assert readable == [4] * MAX_EDGES + [0]  # one block's edges are bounded
    for n in range(17):
        kv.free(f"q{n}")
    kv.allocate("x", 12)  # every block, the cached one evicted
    assert kv.prompt_rows.num_blocks == 0


# ---- the engine ----------------------------------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer briefly and precisely, and never make things up. " * 3


def _cold_and_warm(model: str, prompts: list[str], params: SamplingParams, **args):
    """Each prompt's output with the cache off, then on a warm engine (each prompt sent twice, the
    second time alone), with the prompt positions each warm request computed."""
    with LLM(model, multiprocess=False, enable_prefix_caching=False, **args) as llm:
        cold = llm.generate(prompts, params, use_tqdm=False)
    warm, computed = [], []
    with LLM(model, multiprocess=False, enable_prefix_caching=True, **args) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        for prompt in prompts:
            before = llm.get_engine_stats().num_prefill_tokens
            warm.append(llm.generate(prompt, params, use_tqdm=False)[0])
            computed.append(llm.get_engine_stats().num_prefill_tokens - before)
        assert free_blocks_are_all(llm)
    return cold, warm, computed


@pytest.mark.parametrize(
    "args",
    [dict(num_kv_blocks=512), dict(num_kv_blocks=512, max_num_batched_tokens=24)],
    ids=["whole", "chunked"],
)
def test_a_warm_request_computes_only_its_uncached_positions_and_equals_a_cold_run(tiny_path, args):
    prompts = [SYSTEM + p for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=5, logprobs=2)
    cold, warm, computed = _cold_and_warm(tiny_path, prompts, params, **args)
    for c, w, n in zip(cold, warm, computed):
        num_prompt = len(c.prompt_token_ids)
        assert w.num_cached_tokens == (num_prompt - 1) // 16 * 16 > 0
        assert n == num_prompt - w.num_cached_tokens  # only the uncached positions
        assert w.prompt_logprobs == c.prompt_logprobs  # Logprob equality: bit for bit
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
        assert w.outputs[0].logprobs == c.outputs[0].logprobs


def test_shared_prefixes_with_other_continuations_read_the_shared_blocks(tiny_path):
    """One system prompt, several questions: each question reads the system prompt's blocks (and the
    rows they keep) and computes from where it differs, whatever else shares its batch."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    prompts = [SYSTEM + p for p in PROMPTS[:6]]
    with LLM(tiny_path, multiprocess=False, enable_prefix_caching=False, num_kv_blocks=512) as llm:
        cold = llm.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_path, multiprocess=False, enable_prefix_caching=True, num_kv_blocks=512) as llm:
        llm.generate(SYSTEM, params, use_tqdm=False)
        warm = llm.generate(prompts, params, use_tqdm=False)
    assert all(w.num_cached_tokens >= 48 for w in warm)  # the system prompt's full blocks at least
    assert [w.prompt_logprobs for w in warm] == [c.prompt_logprobs for c in cold]


def test_other_flavours_compute_and_still_equal_a_cold_run(tiny_path):
    """Rows kept at one k or temperature are not read at another (and candidates always compute); each
    request keeps its own flavour's rows for the next (candidates' requests without their columns)."""
    base = dict(temperature=0.0, max_tokens=2)
    flavours = [
        SamplingParams(prompt_logprobs=5, **base),
        SamplingParams(prompt_logprobs=2, **base),
        SamplingParams(prompt_logprobs=5, prompt_logprobs_temperature=0.7, **base),
        SamplingParams(prompt_logprobs=1, prompt_logprob_token_ids=[5, 6, 7], **base),
        SamplingParams(prompt_logprobs=1, **base),  # reads the rows the candidates' request kept
    ]
    prompt = SYSTEM + PROMPTS[0]
    with LLM(tiny_path, multiprocess=False, enable_prefix_caching=False) as llm:
        cold = [llm.generate(prompt, p, use_tqdm=False)[0] for p in flavours]
    with LLM(tiny_path, multiprocess=False, enable_prefix_caching=True) as llm:
        first = [llm.generate(prompt, p, use_tqdm=False)[0] for p in flavours]
        second = [llm.generate(prompt, p, use_tqdm=False)[0] for p in flavours]
    assert [o.num_cached_tokens > 0 for o in first] == [False, False, False, False, True]
    assert [o.num_cached_tokens > 0 for o in second] == [True, True, True, False, True]
    for c, f, s in zip(cold, first, second):
        assert f.prompt_logprobs == c.prompt_logprobs and s.prompt_logprobs == c.prompt_logprobs


def test_preempted_warm_requests_take_their_rows_again(tiny_path):
    prompts = [SYSTEM + p for p in PROMPTS[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, ignore_eos=True)
    args = dict(num_kv_blocks=14, max_num_batched_tokens=256)
    with LLM(tiny_path, multiprocess=False, enable_prefix_caching=False, **args) as llm:
        cold = llm.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_path, multiprocess=False, enable_prefix_caching=True, **args) as llm:
        llm.generate(prompts[:1], params, use_tqdm=False)
        warm = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_engine_stats()
    assert stats.num_preemptions > 0 and sum(w.num_cached_tokens for w in warm) > 0
    assert [w.prompt_logprobs for w in warm] == [c.prompt_logprobs for c in cold]


def test_smollm2_warm_prompt_logprobs_are_a_cold_runs_bits():
    """The real model: 20 prompt logprobs of a long document (12 paragraphs: two chunks of the 128-token
    budget, a dozen KV blocks), read back from the cache."""
    text = " ".join(f"Paragraph {i}: the river rose after the storm and the bridge held." for i in range(12))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20)
    args = dict(dtype=TEST_DTYPE, num_threads=1, max_num_batched_tokens=128)
    cold, warm, computed = _cold_and_warm(builtin_model_path("smollm2"), [text], params, **args)
    assert len(cold[0].prompt_token_ids) > 128  # longer than a chunk
    assert warm[0].num_cached_tokens >= len(cold[0].prompt_token_ids) - 16
    assert computed[0] <= 16
    assert warm[0].prompt_logprobs == cold[0].prompt_logprobs
