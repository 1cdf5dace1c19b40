"""Integer mode (quantized_activations="int8", docs/quantized.md) keeps every bitwise guarantee the engine
states, with its own numbers: a request alone equals it among 32 (the fused decode forward and the
op-by-op products alike), prefill chunks of 16, 64 and 512 and a cold or warm prefix cache give the same
bits, one thread equals two, multi-step equals one step, a spawned core, a daemon and the server equal
the in-process engine, speculation changes nothing, and scoring equals generation. On a random file of
Q4_K_M's mix (Q4_K, Q5_K and Q6_K runs, a Q6_K output) and on the real SmolLM2 (Q4_1, a Q8_0 table).
The mode is really on: its numbers differ from exact mode's, by little."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, running_daemon
from gguf_families import write_family_gguf
from gguf_files import write_gguf_model
from server_harness import running_server
from test_batch_invariance import sampled_rows, scoring_mismatches

from coreserve import LLM, SamplingParams
from coreserve.worker.models.quantized import QuantLinear

sys.path.insert(0, str(ROOT / "scripts"))
from real_models import path_of  # noqa: E402

SAMPLED = SamplingParams(max_tokens=12, logprobs=5, temperature=0.6, seed=1234)
INT8 = {"quantized_activations": "int8"}
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of",
                "Here is a list of fruits: apple, banana,", "To make a cup of tea, first",
                "The three primary colours are", "In 1969, the first person to walk on the Moon",
                "A haiku about autumn:\n"]


def prompts_of(count: int, seed: int, vocab: int = 2048, max_len: int = 40) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_len))]}
            for _ in range(count)]


def rows_of(outputs) -> list:
    return [sampled_rows(o) for o in outputs]


def int8_llm(model: str, **kwargs) -> LLM:
    """An in-process engine in integer mode, checked to run it (a comparison between two engines that had
    both dropped the mode would pass)."""
    llm = LLM(model, multiprocess=False, **INT8, **kwargs)
    assert llm.client.core.executor.backend.is_int8 and llm.client.core.executor.model.ops.is_int8
    return llm


@pytest.fixture(scope="module")
def q4_k_m_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("int8") / "q4_k_m.gguf"
    mixed = {"model.layers.1.self_attn.v_proj.weight": "Q6_K", "model.layers.1.mlp.down_proj.weight": "Q6_K",
             "model.layers.0.mlp.gate_proj.weight": "Q5_K", "lm_head.weight": "Q6_K"}
    write_gguf_model(Path(path), mixed, "Q4_K", vocab_size=2048)
    return str(path)


@pytest.fixture(scope="module")
def llm(q4_k_m_path):
    with int8_llm(q4_k_m_path, num_kv_blocks=1024) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm) -> list:
    return rows_of(llm.generate(prompts_of(32, 0), SAMPLED, use_tqdm=False))


def test_each_of_32_prompts_alone_equals_all_batched_fused_and_op_by_op(llm, reference):
    runner = llm.client.core.executor
    assert runner.backend.is_int8 and runner.backend.fused.applies  # 1-16 decode rows: the fused forward
    prompts = prompts_of(32, 0)
    for i in range(0, 32, 3):
        assert rows_of(llm.generate([prompts[i]], SAMPLED, use_tqdm=False)) == [reference[i]], i


def test_scoring_equals_generation(llm):
    outputs = llm.generate(prompts_of(4, 5), SAMPLED, use_tqdm=False)
    assert sum(scoring_mismatches(llm, out) for out in outputs) == 0


@pytest.mark.parametrize("prefix_len", [15, 17, 100])
def test_chunk_sizes_and_a_prefix_cold_then_warm_give_the_same_bits(q4_k_m_path, prefix_len):
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(3, 2048) for _ in range(prefix_len)]
    first, second = ({"prompt_token_ids": prefix + [rng.randrange(3, 2048) for _ in range(9)]} for _ in range(2))
    with int8_llm(q4_k_m_path, enable_prefix_caching=False) as cold:
        expected = [rows_of(cold.generate([p], SAMPLED, use_tqdm=False)) for p in (first, second)]
    for chunk in (16, 64, 512):
        with int8_llm(q4_k_m_path, max_num_batched_tokens=chunk) as chunked:
            assert rows_of(chunked.generate([first], SAMPLED, use_tqdm=False)) == expected[0], chunk
            warm = chunked.generate([second], SAMPLED, use_tqdm=False)
            assert warm[0].num_cached_tokens == prefix_len // 16 * 16
            assert rows_of(warm) == expected[1], chunk


def test_one_and_two_threads_and_multi_step_give_the_same_bits(llm, q4_k_m_path, reference):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert rows_of(llm.generate(prompts_of(32, 0), SAMPLED, use_tqdm=False)) == reference
    finally:
        torch.set_num_threads(before)
    assert before >= 2
    with int8_llm(q4_k_m_path, num_scheduler_steps=8) as multi:
        assert rows_of(multi.generate(prompts_of(32, 0), SAMPLED, use_tqdm=False)) == reference


def test_a_spawned_core_a_daemon_and_the_server_equal_in_process(q4_k_m_path, reference, tmp_path):
    import openai

    prompts = prompts_of(32, 0)
    with LLM(q4_k_m_path, num_threads=1, **INT8) as spawned:
        assert rows_of(spawned.generate(prompts[:8], SAMPLED, use_tqdm=False)) == reference[:8]
    address = f"ipc://{tmp_path}/core"
    with running_daemon(q4_k_m_path, address, "--quantized-activations", "int8"), LLM(
        q4_k_m_path, core_address=address
    ) as attached:
        assert rows_of(attached.generate(prompts[:4], SAMPLED, use_tqdm=False)) == reference[:4]
    with running_server("--quantized-activations", "int8", model=q4_k_m_path) as (base, _), openai.OpenAI(
        base_url=base + "/v1", api_key="none"
    ) as client:
        for prompt, rows in zip(prompts[:3], reference[:3]):
            served = client.completions.create(
                model=q4_k_m_path, prompt=prompt["prompt_token_ids"], max_tokens=12, logprobs=5,
                temperature=0.6, seed=1234,
            ).choices[0].logprobs
            assert served.token_logprobs == [next(v for i, v, _ in entries if i == token) for token, entries in rows]


def test_speculation_changes_nothing(q4_k_m_path):
    repeated = [{"prompt_token_ids": [7, 8, 9, 10, 11] * 6}, *prompts_of(3, 9)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5, prompt_logprobs=5)
    with int8_llm(q4_k_m_path) as plain:
        expected = plain.generate(repeated, params, use_tqdm=False)
    with int8_llm(q4_k_m_path, speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as speculating:
        outputs = speculating.generate(repeated, params, use_tqdm=False)
        drafted = speculating.get_engine_stats().spec_num_draft_tokens
    assert drafted > 0  # proposals were made and verified
    for out, want in zip(outputs, expected):
        assert rows_of([out]) == rows_of([want])
        assert [None if d is None else {t: (v.logprob, v.rank) for t, v in d.items()} for d in out.prompt_logprobs] == [
            None if d is None else {t: (v.logprob, v.rank) for t, v in d.items()} for d in want.prompt_logprobs]


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_trained_files_alone_equal_batched_scoring_equals_generation_and_stay_near_exact_mode(name):
    """The real SmolLM2 (Q4_1, a Q8_0 table) and Gemma 3 270M (Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 tensors;
    sandwich norms, local and global attention), fetched by scripts/setup.sh --test."""
    model = str(path_of(name))
    prompts = TEXT_PROMPTS * 2  # text, as users send (random ids drive Gemma's outlier activations further)
    first_row = SamplingParams(max_tokens=1, temperature=0, logprobs=5)  # the rows compared with exact mode
    with int8_llm(model, num_kv_blocks=512) as llm:
        batched = llm.generate(prompts, SAMPLED, use_tqdm=False)
        for i in (0, 7, 12):
            assert rows_of(llm.generate([prompts[i]], SAMPLED, use_tqdm=False)) == rows_of([batched[i]])
        assert scoring_mismatches(llm, batched[5]) == 0
        integer = llm.generate(TEXT_PROMPTS, first_row, use_tqdm=False)
    with LLM(model, multiprocess=False, num_kv_blocks=512) as exact_llm:
        exact = exact_llm.generate(TEXT_PROMPTS, first_row, use_tqdm=False)
    first = [(o.outputs[0].logprobs[0], e.outputs[0].logprobs[0]) for o, e in zip(integer, exact)]
    distances = [abs(a[t].logprob - b[t].logprob) for a, b in first for t in a if t in b]
    assert max(distances) > 0  # the mode is on
    assert max(distances) < 0.3  # and near exact mode (docs/quantized.md has the measured distances)


@pytest.mark.parametrize("family", ["qwen3_moe", "phi3"])
def test_experts_and_fused_projections_in_blocks_keep_alone_equal_batched_in_integer_mode(family, family_model,
                                                                                       tmp_path):
    """A mixture of experts (each expert's products on the rows routed to it) and Phi-3's fused q/k/v and
    gate/up, kept in Q8_0 blocks: integer mode's bits do not depend on the batch, and scoring equals
    generation."""
    path = tmp_path / f"{family}-q8_0.gguf"
    write_family_gguf(family_model(family), family, path, weight_type="Q8_0")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 20000 + 100 for j in range(5 + 9 * i)]} for i in range(6)]
    with int8_llm(str(path), num_kv_blocks=256) as llm:
        model = llm.client.core.executor.model
        assert family != "qwen3_moe" or any(".experts." in n for n, m in model.named_modules()
                                            if isinstance(m, QuantLinear))
        batched = llm.generate(prompts, SAMPLED, use_tqdm=False)
        for i in (0, 3, 5):
            assert rows_of(llm.generate([prompts[i]], SAMPLED, use_tqdm=False)) == rows_of([batched[i]])
        assert scoring_mismatches(llm, batched[2]) == 0


def test_integer_mode_is_refused_where_it_cannot_run(tiny_path):
    with pytest.raises(ValueError, match="CPU's C kernels only"):
        LLM(tiny_path, multiprocess=False, can_use_cpu_kernels=False, **INT8)
    with pytest.raises(ValueError, match="weights kept in GGUF blocks"):
        LLM(tiny_path, multiprocess=False, **INT8)
