"""Batch invariance (issue 23): a request's logprobs are the same bits whatever else runs (the batch, the
prefill chunk size, a warm or cold prefix cache, multi-step, the thread count, the process it runs in),
and the prompt logprobs of prompt + completion equal the sampled logprobs the completion was made with;
Qwen3.5's attention output gate at a width that is not whole vectors of torch's loops.
Every comparison is exact (==, no tolerance), in fp32 and in bf16 mode (CORESERVE_TEST_DTYPE); the
broad sweeps run on the built-in tiny model, the headline checks on the real SmolLM2. A negative control
turns invariance off and must find differences, so the comparisons can fail."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import IS_BF16_MODE, running_daemon
from server_harness import running_server

from coreserve import LLM
from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.protocol.sampling_params import SamplingParams

SAMPLED = SamplingParams(max_tokens=16, logprobs=5, temperature=0.6, seed=1234)


def random_prompts(count: int, seed: int, max_len: int = 60) -> list[dict]:
    """Token-id prompts of random lengths (1..max_len), ids well inside both vocabularies."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(1, max_len))]}
            for _ in range(count)]


def sampled_rows(output) -> list:
    """Per generated token: its id and every listed (id, logprob, rank), in order."""
    completion = output.outputs[0]
    return [(token, [(i, e.logprob, e.rank) for i, e in entry.items()])
            for token, entry in zip(completion.token_ids, completion.logprobs)]


def scoring_mismatches(llm: LLM, output) -> int:
    """Scores prompt + completion with prompt_logprobs=5; counts the completion's tokens whose listed
    entries (ids, logprobs, ranks) differ from the ones it was sampled with."""
    completion = output.outputs[0]
    sequence = list(output.prompt_token_ids) + list(completion.token_ids)
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    scored = llm.generate([{"prompt_token_ids": sequence}], params, use_tqdm=False)[0].prompt_logprobs
    first = len(output.prompt_token_ids)
    mismatches = 0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        prompt_entry = scored[first + i]
        same = prompt_entry[token] == entry[token]
        same &= all(prompt_entry.get(t) == e for t, e in entry.items() if e.rank <= 5)
        mismatches += not same
    return mismatches


def alone_vs_batched(llm: LLM, prompts: list, params: SamplingParams, alone: range) -> int:
    batched = llm.generate(prompts, params, use_tqdm=False)
    return sum(sampled_rows(llm.generate([prompts[i]], params, use_tqdm=False)[0]) != sampled_rows(batched[i])
               for i in alone)


@pytest.fixture(scope="module")
def llm(tiny_path):
    with LLM(tiny_path, multiprocess=False, num_kv_blocks=2048) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm) -> list:
    """The 32 prompts' rows, all batched in one call: what every other run must give."""
    return [sampled_rows(o) for o in llm.generate(random_prompts(32, 0), SAMPLED, use_tqdm=False)]


def test_each_of_32_prompts_alone_equals_all_batched(llm, reference):
    prompts = random_prompts(32, 0)
    for prompt, expected in zip(prompts, reference):
        assert sampled_rows(llm.generate([prompt], SAMPLED, use_tqdm=False)[0]) == expected


def test_a_needle_alone_equals_the_needle_among_64_fillers_of_random_lengths(llm):
    rng = random.Random(5)
    needle = random_prompts(1, 99, max_len=40)[0]
    params = SamplingParams(max_tokens=64, logprobs=5, temperature=0.6, seed=7, ignore_eos=True)
    fillers = random_prompts(64, 6, max_len=200)
    filler_params = [SamplingParams(max_tokens=rng.randint(1, 64), temperature=0.8, seed=i, logprobs=2)
                     for i in range(64)]
    place = rng.randrange(65)
    prompts = fillers[:place] + [needle] + fillers[place:]
    mixed = llm.generate(prompts, filler_params[:place] + [params] + filler_params[place:], use_tqdm=False)
    alone = llm.generate([needle], params, use_tqdm=False)[0]
    assert len(alone.outputs[0].token_ids) == 64
    assert sampled_rows(mixed[place]) == sampled_rows(alone)


def test_prompt_logprobs_of_the_generated_sequence_equal_its_sample_logprobs(llm):
    outputs = llm.generate(random_prompts(4, 11), SAMPLED, use_tqdm=False)
    assert [scoring_mismatches(llm, out) for out in outputs] == [0, 0, 0, 0]


@pytest.fixture(scope="module")
def chunked(tiny_path):
    """Engines whose steps hold at most 16, 64 and 512 tokens (longer prompts prefill in chunks), prefix
    caching on; and one at 512 without it, whose runs are all cold. All with every torch.empty filled
    with NaN (coreserve/worker/nan_empties.py): equal bits prove no unwritten byte reaches a logprob."""
    engines = {chunk: LLM(tiny_path, multiprocess=False, max_num_batched_tokens=chunk, num_kv_blocks=256,
                          fill_empty_with_nan=True)
               for chunk in (16, 64, 512)}
    engines["cold"] = LLM(
        tiny_path, multiprocess=False, max_num_batched_tokens=512, enable_prefix_caching=False,
        fill_empty_with_nan=True,
    )
    yield engines
    for engine in engines.values():
        engine.shutdown()


@pytest.mark.parametrize("prefix_len", [1, 15, 16, 17, 511])
def test_chunk_sizes_16_64_512_and_a_prefix_cold_then_warm_give_the_same_bits(chunked, prefix_len):
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(100, 20000) for _ in range(prefix_len)]
    first, second = ({"prompt_token_ids": prefix + [rng.randrange(100, 20000) for _ in range(9)]}
                     for _ in range(2))
    expected = [
        sampled_rows(chunked["cold"].generate([p], SAMPLED, use_tqdm=False)[0]) for p in (first, second)
    ]
    num_tokens = prefix_len + 9
    for chunk in (16, 64, 512):
        llm = chunked[chunk]
        cold = llm.generate([first], SAMPLED, use_tqdm=False)[0]  # its prefix is new to this engine
        warm_prefix = llm.generate([second], SAMPLED, use_tqdm=False)[0]  # reads the prefix's full blocks
        warm_all = llm.generate([second], SAMPLED, use_tqdm=False)[0]  # reads all it may: num_tokens - 1
        assert (cold.num_cached_tokens, warm_prefix.num_cached_tokens, warm_all.num_cached_tokens) == (
            0, prefix_len // 16 * 16, (num_tokens - 1) // 16 * 16
        )
        assert sampled_rows(cold) == expected[0], chunk
        assert sampled_rows(warm_prefix) == sampled_rows(warm_all) == expected[1], chunk


def test_one_and_two_threads_give_the_same_bits(llm, reference):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = [sampled_rows(o) for o in llm.generate(random_prompts(32, 0), SAMPLED, use_tqdm=False)]
    finally:
        torch.set_num_threads(before)
    assert before >= 2 and single == reference


def test_multi_step_8_equals_1(tiny_path, reference):
    with LLM(tiny_path, multiprocess=False, num_scheduler_steps=8, fill_empty_with_nan=True) as llm:
        outputs = llm.generate(random_prompts(32, 0), SAMPLED, use_tqdm=False)
    assert [sampled_rows(o) for o in outputs] == reference


def test_a_spawned_core_with_one_thread_and_a_daemon_equal_in_process(tiny_path, reference, tmp_path):
    prompts = random_prompts(32, 0)
    with LLM(tiny_path, num_threads=1) as spawned:
        assert [sampled_rows(o) for o in spawned.generate(prompts, SAMPLED, use_tqdm=False)] == reference
    address = f"ipc://{tmp_path}/core"
    with running_daemon(tiny_path, address), LLM(tiny_path, core_address=address) as attached:
        assert [
            sampled_rows(o) for o in attached.generate(prompts[:8], SAMPLED, use_tqdm=False)
        ] == reference[:8]


def test_the_server_gives_the_in_process_logprobs(llm):
    import openai

    prompts = random_prompts(4, 21)
    expected = llm.generate(prompts, SAMPLED, use_tqdm=False)
    with running_server() as (base, _), openai.OpenAI(base_url=base + "/v1", api_key="none") as client:
        for prompt, out in zip(prompts, expected):
            served = client.completions.create(
                model="builtin:tiny", prompt=prompt["prompt_token_ids"], max_tokens=16, logprobs=5,
                temperature=0.6, seed=1234,
            ).choices[0].logprobs
            completion = out.outputs[0]
            assert served.token_logprobs == [
                e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)
            ]
            # the legacy top_logprobs: the sampled token and the top 5, keyed by text
            assert [sorted(d.values()) for d in served.top_logprobs] == [
                sorted(lp.logprob for lp in e.values()) for e in completion.logprobs
            ]


def test_negative_control_without_invariance_the_comparisons_find_differences(tiny_path):
    """The same comparisons with batch_invariant=False: prefill (SDPA) and decode (the kernel) sum the
    attention differently, and in fp32 the many-row products are MKL's, so the checks above can fail."""
    with LLM(tiny_path, multiprocess=False, batch_invariant=False) as llm:
        outputs = llm.generate(random_prompts(4, 11), SAMPLED, use_tqdm=False)
        assert sum(scoring_mismatches(llm, out) for out in outputs) > 0
        if not IS_BF16_MODE:  # bf16 products are the dot kernel's at every row count either way
            assert alone_vs_batched(llm, random_prompts(32, 0), SAMPLED, range(0, 32, 8)) > 0


@pytest.fixture(scope="module")
def smollm2():
    dtype = "bfloat16" if IS_BF16_MODE else "auto"
    with LLM(builtin_model_path("smollm2"), multiprocess=False, dtype=dtype, num_kv_blocks=512) as llm:
        yield llm


def test_smollm2_prompts_alone_equal_32_batched_and_scoring_equals_generation(smollm2):
    prompts = random_prompts(32, 3, max_len=24)
    params = SamplingParams(max_tokens=16, logprobs=5, temperature=0.6, seed=77)
    batched = smollm2.generate(prompts, params, use_tqdm=False)
    for i in (0, 13, 31):
        assert sampled_rows(smollm2.generate([prompts[i]], params, use_tqdm=False)[0]) == sampled_rows(
            batched[i]
        )
    assert scoring_mismatches(smollm2, batched[5]) == 0


def test_an_output_gate_not_whole_vectors_wide_gives_the_same_bits_alone_and_batched(tmp_path):
    """Qwen3.5's attention output gate, 3 heads of 24 (72 wide: torch's sigmoid rounds the elements past its
    vector loop otherwise, so a decode row's bits depended on the rows beside it: the fuzzer's
    qwen3_5-mixed-seed1048), through the ops' sigmoid: a request's bits alone and batched."""
    from gguf_fuzz_files import peaked_init
    from transformers import AutoConfig, AutoModelForCausalLM

    from coreserve.protocol.builtin_model import make_tokenizer

    config = AutoConfig.for_model(
        "qwen3_5_text", hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=16, linear_value_head_dim=16,
        vocab_size=50304, bos_token_id=50256, eos_token_id=50256, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(peaked_init(name, param))
    model.save_pretrained(str(tmp_path))
    make_tokenizer().save_pretrained(str(tmp_path))
    prompts = [{"prompt_token_ids": [464, 3139, 286, 4881, 318]}, {"prompt_token_ids": list(range(300, 340))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    with LLM(str(tmp_path), multiprocess=False, dtype="float32") as llm:
        alone = llm.generate(prompts[:1], greedy, use_tqdm=False)[0]
        batched = llm.generate(prompts, greedy, use_tqdm=False)[0]
    assert sampled_rows(alone) == sampled_rows(batched)
