"""Speculative decoding changes nothing but the speed (docs/speculative.md): with it on, every request
gets the same token ids, text, sample logprobs (top 5, ranks) and prompt logprobs as with it off, bit for
bit, greedy and seeded at temperature 0.8, alone and in a batch with requests that do not speculate; a
stop string inside a kept run; a grammar; the server streaming. The real SmolLM2 (its Q4_1 file, and
its fp32 weights with the Q4_1 file as draft) and the built-in tiny model. A negative control shows the
comparison can fail: without batch invariance the verification rows round differently.
"""

from __future__ import annotations

import json

import pytest
from conftest import IS_BF16_MODE
from server_harness import running_server

from coreserve import LLM, SamplingParams
from coreserve.engine_core.request import Request
from coreserve.engine_core.speculation import MAX_PAUSE, STEP_ROWS, SpeculationPolicy
from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.protocol.config import SpeculativeConfig, parse_speculative_config
from coreserve.protocol.prompt_lookup import lookup
from coreserve.protocol.structured_outputs import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n"
)
PASSAGE = (
    'The report said: "The river rose four metres overnight, and the old bridge closed at dawn." '
    'The mayor added: "Nobody was hurt, and the bridge will reopen when the water falls."'
)
CHATS = [
    [{"role": "user", "content": "Rename the function mean to average and show the whole code:\n" + CODE}],
    [{"role": "user", "content": PASSAGE + "\nWhat did the mayor say? Quote him exactly."}],
    [{"role": "user", "content": "Write two sentences about autumn."}],
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And what is the capital of Italy?"},
    ],
]
PHRASE = [5012, 318, 257, 1332, 286, 262, 3288, 11]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, logprobs=5, prompt_logprobs=5)
SEEDED = SamplingParams(max_tokens=48, temperature=0.8, seed=11, logprobs=5, prompt_logprobs=5)


def everything(output) -> tuple:
    """What a request returns that speculation must not change: ids, text, every sample logprob entry
    (id, value, rank), and the prompt logprobs (n > 1: the other completions' after)."""
    completion = output.outputs[0]
    rows = [[(i, e.logprob, e.rank) for i, e in entry.items()] for entry in completion.logprobs or []]
    prompt = [
        None if entry is None else [(i, e.logprob, e.rank) for i, e in entry.items()]
        for entry in output.prompt_logprobs or []
    ]
    others = [(c.token_ids, c.text, c.cumulative_logprob, c.finish_reason) for c in output.outputs[1:]]
    return completion.token_ids, completion.text, rows, prompt, completion.finish_reason, others


def chat_all(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    return [everything(o) for o in llm.chat(CHATS * (len(params) // len(CHATS)), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def smollm2_engines():
    """The SmolLM2 file (Q4_1 kept quantized) with speculation off and on (ngram), one engine each for
    the module's SmolLM2 tests (two loads, not eight); a test reads the counters' growth over its own
    requests. Each test sends both engines the same requests in the same order."""
    dtype = "bfloat16" if IS_BF16_MODE else "auto"
    engines = {}
    for name, extra in (("off", {}), ("on", {"speculative_config": NGRAM})):
        engines[name] = LLM(builtin_model_path("smollm2"), multiprocess=False, dtype=dtype, num_kv_blocks=512, **extra)
    yield engines
    for llm in engines.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def smollm2_outputs(smollm2_engines):
    """Speculation off, then on: each chat alone, greedy and seeded, and 16 of them batched (a quarter
    opted out) with 4 grammar requests."""
    params = [GREEDY] * 4 + [SEEDED] * 4
    results = {}
    for name, llm in smollm2_engines.items():
        first = llm.get_engine_stats()
        alone = [everything(llm.chat([chat], p, use_tqdm=False)[0]) for chat, p in zip(CHATS * 2, params)]
        before = llm.get_engine_stats()
        batch = llm.chat(CHATS * 4 + [CHATS[2]] * 4, batch_params() + [grammar_params()] * 4, use_tqdm=False)
        stats = llm.get_engine_stats()
        grown = (stats.spec_num_accepted_tokens - first.spec_num_accepted_tokens,
                 stats.spec_num_draft_tokens - first.spec_num_draft_tokens)
        results[name] = (alone, [everything(o) for o in batch], grown,
                         stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens)
    return results


def batch_params() -> list[SamplingParams]:
    """16 requests, greedy and seeded, of 12 to 57 tokens: the batch shrinks as they finish, and once it
    leaves room (STEP_ROWS) the rest speculate beside the ones that do not (opted out)."""
    return [
        SamplingParams(
            max_tokens=12 + 3 * i,
            temperature=0.8 if i % 2 else 0.0,
            seed=11,
            logprobs=5,
            prompt_logprobs=5,
            disable_spec_decode=i % 4 == 3,  # a quarter opt out: they run beside the ones that speculate
        )
        for i in range(16)
    ]


def grammar_params() -> SamplingParams:
    schema = {"type": "object", "properties": {"season": {"type": "string"}}, "required": ["season"]}
    return SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, structured_outputs=StructuredOutputsParams(json=schema))


def test_smollm2_with_ngram_speculation_equals_without_alone_and_in_a_batch(smollm2_outputs):
    off_alone, off_batch, *_ = smollm2_outputs["off"]
    on_alone, on_batch, (accepted, drafted), kept_in_batch = smollm2_outputs["on"]
    assert on_alone == off_alone
    assert on_batch == off_batch
    assert accepted > 0 and drafted > accepted
    # in the batch too, once it is small enough to have room for proposals (STEP_ROWS)
    assert kept_in_batch > 0
    # the grammar rows: valid JSON, the same as without speculation
    assert all(json.loads(text)["season"] for _, text, *_ in on_batch[-4:])


def test_a_stop_string_or_stop_token_inside_a_kept_run_ends_it_as_without_speculation(smollm2_engines):
    chat = CHATS[0]
    plain = smollm2_engines["off"].chat([chat], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 6]  # a string in the middle of the copied code
    stop_token = plain.token_ids[len(plain.token_ids) * 2 // 3]
    params = [
        SamplingParams(max_tokens=48, temperature=0.0, logprobs=5, stop=[stop]),
        SamplingParams(max_tokens=48, temperature=0.0, logprobs=5, stop_token_ids=[stop_token]),
    ]
    got = {}
    for name, llm in smollm2_engines.items():
        before = llm.get_engine_stats().spec_num_accepted_tokens
        got[name] = [everything(llm.chat([chat], p, use_tqdm=False)[0]) for p in params]
        kept = llm.get_engine_stats().spec_num_accepted_tokens - before
    assert got["on"] == got["off"]
    assert kept > 0
    (_, text, *_, reason, _), (ids, *_, token_reason, _) = got["on"]
    assert reason == "stop" and stop not in text
    assert token_reason == "stop" and ids[-1] == stop_token and len(ids) < 48


def test_a_grammar_request_speculates_its_proposals_cut_by_the_grammar_and_gets_the_same_output(smollm2_engines):
    """Prompt lookup for a JSON-schema request: the core's matcher walks the proposals (cut at the first
    token the grammar refuses) and gives each verified position its own mask row."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "city", "age"],
    }
    chat = [{"role": "user", "content": 'A record: {"name": "Alice Martin", "city": "Lyon", "age": 34}. Write it as JSON.'}]
    params = [
        SamplingParams(max_tokens=60, temperature=t, seed=3, logprobs=2, structured_outputs=StructuredOutputsParams(json=schema))
        for t in (0.0, 0.8)
    ]
    got = {}
    for name, llm in smollm2_engines.items():
        outputs = llm.chat([chat, chat], params, use_tqdm=False)
        got[name] = [(everything(o), o.outputs[0].constraint_masses) for o in outputs]
        kept = [o.metrics.get("spec_num_accepted_tokens", 0) for o in outputs]
    assert got["on"] == got["off"]
    assert all(k > 0 for k in kept)  # both requests kept proposals under their grammar
    assert all(json.loads(text)["city"] for (_, text, *_), _ in got["on"])


def drafted_by_q4_1(dtype: str) -> tuple[bool, object]:
    """SmolLM2 loaded in `dtype`, drafted by its Q4_1 file: whether every chat's output (greedy and
    seeded) equals plain decoding's, and the speculating engine's stats."""
    path = builtin_model_path("smollm2")
    draft = {"method": "draft_model", "model": "builtin:smollm2", "num_speculative_tokens": 4}
    got = {}
    for name, extra in (("off", {}), ("on", {"speculative_config": draft})):
        with LLM(path, multiprocess=False, dtype=dtype, num_kv_blocks=256, **extra) as llm:
            got[name] = (chat_all(llm, [GREEDY, SEEDED] * 2), llm.get_engine_stats())
    return got["on"][0] == got["off"][0], got["on"][1]


@pytest.mark.fp32_exact("the draft is the Q4_1 file, bit-equal to the fp32 target only in fp32")
def test_fp32_smollm2_drafted_by_its_q4_1_file_equals_plain_fp32_and_keeps_every_proposal():
    is_equal, stats = drafted_by_q4_1("float32")
    assert is_equal
    # Q4_1 kept in blocks gives the fp32 model's bits, and the draft samples with the same noise: every
    # proposal is the model's own token
    assert stats.spec_num_draft_tokens > 50 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


@pytest.mark.skipif(IS_BF16_MODE, reason="the bf16 run of the suite loads its own dtype; this one names both")
def test_bf16_smollm2_drafted_by_its_q4_1_file_equals_plain_bf16():
    is_equal, stats = drafted_by_q4_1("bfloat16")
    assert is_equal
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens / 2  # a close draft, not an equal one


def test_tensor_parallel_ngram_speculation_equals_plain_tensor_parallel(tiny_path):
    prompts = repeating_prompts()
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=9, logprobs=3, ignore_eos=True, allowed_token_ids=PHRASE[:4])
    results = []
    for extra in ({}, {"speculative_config": {**NGRAM, "prompt_lookup_min": 1}}):
        with LLM(tiny_path, tensor_parallel_size=2, num_kv_blocks=64, **extra) as llm:
            results.append(([everything(o) for o in llm.generate(prompts, params, use_tqdm=False)], llm.get_engine_stats()))
    assert results[1][0] == results[0][0]
    assert results[1][1].spec_num_accepted_tokens > 0


def repeating_prompts() -> list[dict]:
    """Token-id prompts that repeat a phrase: prompt lookup proposes on the random-weight model too."""
    return [{"prompt_token_ids": PHRASE * 4 + [100 + i]} for i in range(3)] + [{"prompt_token_ids": PHRASE * 3}]


def tiny_speculation_params() -> list[SamplingParams]:
    """A request for each of repeating_prompts(): greedy and seeded, with and without four allowed tokens
    (the random weights' output then repeats itself, so prompt lookup proposes), processed logprobs after
    a penalty, n = 2."""
    params = [
        SamplingParams(max_tokens=24, temperature=t, seed=3, logprobs=5, ignore_eos=True, allowed_token_ids=allowed)
        for t in (0.0, 0.8)
        for allowed in (None, PHRASE[:4])
    ]
    params = [params[i % 4] for i in range(len(repeating_prompts()))]
    params[-1] = SamplingParams(max_tokens=24, temperature=0.8, seed=5, n=2, logprobs=2, allowed_token_ids=PHRASE[:4])
    params[1] = SamplingParams(  # processed logprobs, after a penalty that counts the proposals before each row
        max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True, allowed_token_ids=PHRASE[:4],
        logprobs_mode="processed_logprobs", presence_penalty=0.5,
    )
    return params


@pytest.fixture(scope="module")
def tiny_plain(tiny_path) -> list[tuple]:
    """The requests' outputs without speculation, whole prompts and single steps: on the C kernels a
    request's bits do not depend on windows, chunks or preemption (test_batch_invariance.py), so every
    engine shape below is held to these."""
    with LLM(tiny_path, multiprocess=False, num_kv_blocks=128) as llm:
        return [everything(o) for o in llm.generate(repeating_prompts(), tiny_speculation_params(), use_tqdm=False)]


@pytest.mark.parametrize(
    "engine_args", [{}, {"num_scheduler_steps": 4}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 6}]
)
def test_tiny_model_speculation_equals_plain_decoding(tiny_path, tiny_plain, engine_args):
    """The built-in model, proposals from a draft identical to it (every one kept) and from prompt lookup
    (mostly rejected: the KV of rejected positions written and left behind), with multi-step windows and
    chunked prefill, and preemption (6 blocks cannot hold the 4 requests): the bits of plain decoding."""
    prompts, params = repeating_prompts(), tiny_speculation_params()
    results = []
    ngram = {**NGRAM, "prompt_lookup_min": 1}
    for spec in (ngram, {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 3}):
        with LLM(tiny_path, multiprocess=False, **{"num_kv_blocks": 128, **engine_args}, speculative_config=spec) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results.append(([everything(o) for o in outputs], llm.get_engine_stats()))
            # per request: RequestOutput.metrics add up to the engine's counters
            kept = sum(o.metrics.get("spec_num_accepted_tokens", 0) for o in outputs)
            proposed = sum(o.metrics.get("spec_num_draft_tokens", 0) for o in outputs)
            assert (proposed, kept) == (results[-1][1].spec_num_draft_tokens, results[-1][1].spec_num_accepted_tokens)
    (ngram, ngram_stats), (draft, draft_stats) = results
    assert ngram == tiny_plain and draft == tiny_plain
    assert 0 < ngram_stats.spec_num_accepted_tokens < ngram_stats.spec_num_draft_tokens  # kept and rejected
    if "num_kv_blocks" in engine_args:
        assert ngram_stats.num_preemptions > 0
    assert draft_stats.spec_num_draft_tokens > 0
    assert draft_stats.spec_num_accepted_tokens == draft_stats.spec_num_draft_tokens


@pytest.mark.fp32_exact("torch's bf16 product kept one order for these shapes (docs/decisions.md)")
def test_negative_control_on_the_torch_path_verification_changes_logprob_bits(tiny_path):
    """Where a step's numbers depend on its shape (the torch path: MKL's products pick their kernel by
    the row count, prefill chunks take SDPA), verifying several rows at once is not decoding them one by
    one, and the same comparison finds differences: the equality above is not one that cannot fail.
    (The C kernels without `batch_invariant` still verify exactly at these sizes: up to 16 rows their
    products are the decode kernel's, and verified rows are decode rows.)"""
    prompts = repeating_prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True, allowed_token_ids=PHRASE[:4])
    draft = {"method": "draft_model", "model": tiny_path, "num_speculative_tokens": 4}
    results = []
    for extra in ({}, {"speculative_config": draft}):
        with LLM(tiny_path, multiprocess=False, num_kv_blocks=128, can_use_cpu_kernels=False, **extra) as llm:
            results.append([everything(o)[2] for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] != results[1]


def test_the_server_streams_the_same_tokens_and_logprobs_with_speculation_and_counts_it(tiny_path):
    import httpx
    import openai

    prompt = repeating_prompts()[0]["prompt_token_ids"]
    with LLM(tiny_path, multiprocess=False, num_kv_blocks=64) as llm:
        params = SamplingParams(max_tokens=24, logprobs=3, temperature=0.0, ignore_eos=True)
        expected = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    spec = json.dumps({"method": "draft_model", "model": "builtin:tiny", "num_speculative_tokens": 3})
    with running_server("--speculative-config", spec) as (base, _):
        with openai.OpenAI(base_url=base + "/v1", api_key="none") as client:
            stream = client.completions.create(
                model="builtin:tiny", prompt=prompt, max_tokens=24, logprobs=3, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True},
            )
            logprobs = [lp for chunk in stream for lp in chunk.choices[0].logprobs.token_logprobs]
        assert logprobs == [entry[t].logprob for t, entry in zip(expected.token_ids, expected.logprobs)]
        metrics = httpx.get(base + "/metrics").text
    accepted = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_vllm_names_are_taken_and_what_is_not_built_is_refused_by_name():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert config.lookup_range() == (4, 4)
    assert parse_speculative_config({"model": "x", "num_speculative_tokens": 2}).method == "draft_model"
    for bad, name in (
        ({"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "colour": 1}, "colour"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ):
        with pytest.raises(ValueError, match=name):
            parse_speculative_config(bad)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(None, tensor_parallel_size=2, speculative_config={"model": "builtin:tiny", "num_speculative_tokens": 2})


def test_a_request_may_opt_out_and_gets_the_same_output(tiny_path):
    prompts = repeating_prompts()
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True, allowed_token_ids=PHRASE[:4])
    opted_out = SamplingParams(
        max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True, allowed_token_ids=PHRASE[:4], disable_spec_decode=True
    )
    with LLM(tiny_path, multiprocess=False, num_kv_blocks=64, speculative_config={**NGRAM, "prompt_lookup_min": 1}) as llm:
        out = [everything(o) for o in llm.generate(prompts, opted_out, use_tqdm=False)]
        assert llm.get_engine_stats().spec_num_draft_tokens == 0
        assert [everything(o) for o in llm.generate(prompts, params, use_tqdm=False)] == out
        assert llm.get_engine_stats().spec_num_draft_tokens > 0


def test_prompt_lookup_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    assert lookup(tokens, 2, 5, 3) == [7, 8, 4]  # "2 3" last seen before the end at index 5
    assert lookup(tokens + [7], 2, 5, 2) == [8, 4]  # "2 3 7" beats the shorter "3 7"
    assert lookup([1, 2, 3, 4], 2, 4, 3) == []
    assert lookup([5, 5, 5, 5], 1, 2, 8) == [5]  # never past the end of the context


def test_a_request_whose_proposals_keep_failing_stops_proposing_for_longer_each_time():
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    req = Request(
        req_id="r", client_id=b"c", client_req_id="r", prompt_token_ids=[1, 2], params=SamplingParams(),
        arrival_time=0.0, eos_token_ids=[], logprobs_mode="raw_logprobs",
    )
    req.output_token_ids = [3]
    policy.begin_step(1)
    assert policy.num_tokens(req, 100, 1000) == 4
    policy.begin_step(STEP_ROWS - 2)  # a fuller batch: room for two
    assert policy.num_tokens(req, 100, 1000) == 2
    policy.begin_step(1)
    policy.record(req, 4, 4)
    policy.record(req, 4, 1)
    assert req.spec_k == 2  # one more than it kept
    pauses = []
    for _ in range(8):
        policy.record(req, 2, 0)
        pauses.append(req.spec_pause)
    assert pauses[0] == 0 and pauses[1:4] == [2, 4, 8] and pauses[-1] == MAX_PAUSE
    assert [policy.num_tokens(req, 100, 1000) for _ in range(MAX_PAUSE)] == [0] * MAX_PAUSE
    policy.begin_step(1)
    assert policy.num_tokens(req, 100, 1000) == 1
    assert policy.num_accepted_tokens == 5 and policy.accepted_per_position == [2, 1, 1, 1]
    capped = SpeculationPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=3))
    capped.begin_step(3)
    assert capped.num_tokens(req, 100, 1000) == 0
    capped.begin_step(2)
    assert capped.num_tokens(req, 100, 1000) == 1  # its proposal length now (one more than it kept)
