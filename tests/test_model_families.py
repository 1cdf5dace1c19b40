"""Each supported family (Llama 2, 3.1, 3.2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, 3 and 4, Qwen3-MoE,
Mixtral, OLMoE, OLMo 2, OLMo 3, SmolLM3, Exaone 4, gpt-oss) against Hugging Face transformers on the same random
weights: greedy tokens, sample and prompt logprobs, past the RoPE thresholds and the sliding window, with
chunked prefill and preemption forced; HF's `generate` (its caches) for the newest; batch invariance for the
families added since the first (alone = batched, scoring = generation); config keys the engine cannot honour
refused. The routed experts: test_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import HF_TOLERANCE, HF_TOLERANCE_TORCH_PATH, IS_BF16_MODE, hf_logprobs, load_hf
from test_batch_invariance import sampled_rows, scoring_mismatches

from coreserve import LLM, SamplingParams
from coreserve.worker.models.config import DecoderArgs

MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")
INVARIANCE_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5),
    SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True, logprobs=5),
]

# Long enough (40-70 tokens) to cross the scaled-down RoPE thresholds (32) and Mistral's window (24).
FAMILY_PROMPTS = [
    "Les sanglots longs des violons de l'automne blessent mon cœur d'une langueur monotone. Tout "
    "suffocant et blême, quand sonne l'heure, je me souviens des jours anciens et je pleure.",
    "日本語のテキストと絵文字 🎉🚀 を混ぜた文章です。東京は日本の首都であり、多くの人が住んでいます。",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])",
    "I can't believe it's already December; we'd planned to finish the project, but they're still "
    "testing and it won't ship until they've fixed the bugs we've found.",
    "The quick brown fox jumps over the lazy dog while the cat watches from the window sill, "
    "thinking about nothing in particular and everything at once.",
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=3),
    SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, logprobs=2),
]
# 16-token chunks force chunked prefill; 8 blocks of 16 cannot hold five ~70-token sequences.
CHUNKED = dict(max_num_batched_tokens=16, num_kv_blocks=8, block_size=16)
CASES = [
    ("llama2", True, CHUNKED),
    ("llama3.1", False, CHUNKED),
    ("llama3.2", False, CHUNKED),
    ("mistral", False, CHUNKED),  # the C decode kernel and chunked prefill across the window
    (
        "mistral",
        True,
        dict(max_num_batched_tokens=512, can_use_cpu_kernels=False),
    ),  # torch paths, whole prompts
    ("mistral", False, dict(num_scheduler_steps=4, can_use_cpu_kernels=False)),  # multi-step windows
    ("qwen2", False, CHUNKED),
    ("qwen3", True, CHUNKED),
    ("phi3", False, CHUNKED),  # fused checkpoint tensors and a window, chunked and preempted
    # a family's numbers do not depend on the process mode (the arrays cross the socket as they are computed:
    # tests/test_llm_greedy.py, test_logprobs.py); both modes still appear across the families
    ("phi3.5", False, CHUNKED),  # LongRoPE's long factors for every position, chunked and preempted
    ("phi4-mini", True, dict(max_num_batched_tokens=512, can_use_cpu_kernels=False)),  # and partial rotary
    ("qwen3_moe", False, CHUNKED),  # mixtures of experts: routed per token, chunked and preempted
    ("mixtral", True, CHUNKED),
    ("olmoe", False, CHUNKED),
    ("qwen3_moe", True, dict(max_num_batched_tokens=512, can_use_cpu_kernels=False)),  # torch's ops
    ("gemma2", False, CHUNKED),  # soft-caps, sandwich norms, local and global layers
    ("gemma2", True, dict(max_num_batched_tokens=512, can_use_cpu_kernels=False)),  # torch's ops
    ("gemma3", True, CHUNKED),  # two RoPE tables, q/k norms
    ("gemma3", False, dict(max_num_batched_tokens=512, can_use_cpu_kernels=False)),
    ("olmo2", False, CHUNKED),  # norms on the outputs only, q/k norms over the whole projections
    ("olmo3", False, CHUNKED),  # and a sliding layer with its own RoPE beside a YaRN global one
    ("smollm3", False, CHUNKED),  # a NoPE layer
    ("exaone4", False, CHUNKED),  # a local layer (window, RoPE), a global one without RoPE, per-head q/k norms
    ("gemma4", False, CHUNKED),  # a proportional RoPE beside a default one, a norm on v, layer scalars
    ("gpt_oss", False, CHUNKED),  # sinks in the C kernel, window 8, YaRN, experts with biases and the clamp
]


@pytest.mark.parametrize(
    "family, multiprocess, engine_args", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_family_matches_hf(family, multiprocess, engine_args, family_model):
    if IS_BF16_MODE and family in MOE_FAMILIES:
        pytest.skip("bf16 routing flips near-ties against fp32 HF (docs/models.md states the measured bound)")
    path = family_model(family)
    prompts = FAMILY_PROMPTS
    params = [PARAMS[i % 2] for i in range(len(prompts))]
    with LLM(path, multiprocess=multiprocess, **engine_args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if "num_kv_blocks" in engine_args:
            assert llm.get_engine_stats().num_preemptions > 0
    hf = load_hf(path)
    tolerance = HF_TOLERANCE if engine_args.get("can_use_cpu_kernels", True) else HF_TOLERANCE_TORCH_PATH
    for output, p in zip(outputs, params):
        completion = output.outputs[0]
        assert len(completion.token_ids) == 16
        reference = hf_logprobs(hf, output.prompt_token_ids + completion.token_ids)
        start = len(output.prompt_token_ids) - 1
        for step, (token_id, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[start + step]
            if p.temperature == 0:  # teacher-forced: HF's argmax, within the tolerance
                assert row[token_id] >= row.max() - tolerance, (family, step)
            for entry_id, logprob in entries.items():
                bound = tolerance + (2**-6 * abs(row[entry_id].item()) if IS_BF16_MODE else 0.0)  # bf16: relative too
                assert abs(logprob.logprob - row[entry_id].item()) < bound, (family, step, entry_id)
        if p.prompt_logprobs is not None:
            _assert_prompt_logprobs(output, reference, tolerance)


# OLMo 2's layers are OLMo 3's without its windows and second RoPE
@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral", "olmoe", "olmo3", "smollm3",
                                    "exaone4", "gemma4", "gpt_oss"])
def test_alone_equals_batched_and_scoring_equals_generation(family, family_model):
    """Each of 5 prompts alone, then all in one batch with 16-token chunks; then the generated sequence
    scored with prompt_logprobs (prefill) against its sample logprobs (decode)."""
    is_moe = family in MOE_FAMILIES  # and their routed experts too
    params = [SamplingParams(**{**_fields(p), "return_routed_experts": is_moe}) for p in INVARIANCE_PARAMS]
    params = [params[i % 2] for i in range(len(FAMILY_PROMPTS))]
    with LLM(family_model(family), multiprocess=False, max_num_batched_tokens=16) as llm:
        alone = [llm.generate([prompt], p, use_tqdm=False)[0] for prompt, p in zip(FAMILY_PROMPTS, params)]
        batched = llm.generate(FAMILY_PROMPTS, params, use_tqdm=False)
        assert [scoring_mismatches(llm, out) for out in batched] == [0] * len(batched)
    for one, many in zip(alone, batched):
        assert sampled_rows(one) == sampled_rows(many)
        if is_moe:
            assert np.array_equal(one.outputs[0].routed_experts, many.outputs[0].routed_experts)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def _assert_prompt_logprobs(output, reference, tolerance: float) -> None:
    assert output.prompt_logprobs[0] is None
    for position, entries in enumerate(output.prompt_logprobs[1:], start=1):
        assert output.prompt_token_ids[position] in entries
        for token_id, logprob in entries.items():
            expected = reference[position - 1, token_id].item()
            bound = tolerance + (2**-6 * abs(expected) if IS_BF16_MODE else 0.0)
            assert abs(logprob.logprob - expected) < bound


def test_hf_config_formats_agree(family_model):
    """transformers 5's rope_parameters and the older rope_scaling + rope_theta give the same model."""
    config = json.loads((Path(family_model("llama3.1")) / "config.json").read_text())
    new = DecoderArgs.from_hf_config(config)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = dict(rope, type=rope.pop("rope_type"))
    assert DecoderArgs.from_hf_config(config) == new
    assert new.rope.rope_type == "llama3" and new.rope.params["original_max_position_embeddings"] == 32


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "short_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ],
)
def test_unsupported_config_is_refused(change, message, family_model):
    config = json.loads((Path(family_model("llama2")) / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        DecoderArgs.from_hf_config({**config, **change})


def test_unsupported_config_is_a_value_error_at_load(family_model, tmp_path):
    source = Path(family_model("llama2"))
    for item in source.iterdir():
        if item.name != "config.json":
            (tmp_path / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config["mlp_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mlp_bias"):
        LLM(str(tmp_path), multiprocess=False)


def test_phi3_under_tensor_parallelism_is_refused_by_name(family_model):
    with pytest.raises(Exception, match="Phi-3"):
        LLM(family_model("phi3"), tensor_parallel_size=2)


def test_gpt_oss_quantizations_but_mxfp4_and_tensor_parallelism_are_refused_by_name(family_model):
    """A quantization_config other than the hub's MXFP4 experts' (tests/test_mxfp4_experts.py), and its sinks and
    experts' biases across ranks: not built yet."""
    import torch

    from coreserve.worker.models.loader import load_model
    from coreserve.worker.models.sharding import Shard

    path = family_model("gpt_oss")
    config = json.loads((Path(path) / "config.json").read_text())
    with pytest.raises(ValueError, match="quantization_config.quant_method='bitsandbytes' is not supported for gpt_oss"):
        DecoderArgs.from_hf_config({**config, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ValueError, match="gpt-oss"):
        load_model(path, "float32", torch.device("cpu"), Shard(rank=0, size=2))


def test_olmo_under_tensor_parallelism_is_refused_by_name(family_model):
    """Its q/k norms span the heads of every rank: a rank's load refuses it (no ranks spawned here)."""
    import torch

    from coreserve.worker.models.loader import load_model
    from coreserve.worker.models.sharding import Shard

    with pytest.raises(ValueError, match="OLMo 2"):
        load_model(family_model("olmo2"), "float32", torch.device("cpu"), Shard(rank=0, size=2))


def hf_generate_logprobs(model, prompt_ids: list[int], completion_ids: list[int]):
    """[len(completion_ids), vocab] float64 log_softmax of the raw logits of HF's `generate` with its
    cache, made to pick `completion_ids` (teacher-forced through a logits processor). HF's Phi-3 picks
    LongRoPE's factors per forward from its positions, and drops its cache where a sequence first
    outgrows the switch, computing it again with the long factors. On one torch thread: a decoding step of
    these small models is many small ops, each waiting for a second thread on the shared 2-core host."""
    import torch
    from hf_reference import one_torch_thread
    from transformers import LogitsProcessor, LogitsProcessorList

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -float("inf"))
            forced[:, completion_ids[input_ids.shape[1] - len(prompt_ids)]] = 0.0
            return forced

    with one_torch_thread():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=len(completion_ids), do_sample=False, pad_token_id=0,
            logits_processor=LogitsProcessorList([Force()]), output_logits=True, return_dict_in_generate=True,
        )
    assert out.sequences[0, len(prompt_ids):].tolist() == completion_ids
    return torch.log_softmax(torch.stack(out.logits)[:, 0].double(), dim=-1)


def _assert_sample_logprobs(completion, reference, tolerance: float) -> None:
    """Each generated token HF's argmax within the tolerance, and every listed logprob HF's."""
    for step, (token_id, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[step]
        assert row[token_id] >= row.max() - tolerance, step
        for entry_id, logprob in entries.items():
            assert abs(logprob.logprob - row[entry_id].item()) < tolerance, (step, entry_id)


@pytest.mark.parametrize("family", ["olmo3", "smollm3", "exaone4", "gpt_oss"])  # OLMo 2's layers are OLMo 3's, unwindowed
def test_new_family_matches_hf_generate(family, family_model):
    """A greedy completion past the window (24) against HF's own decoding with its cache (its sliding-window
    and NoPE layers' caches as HF keeps them), the sampled logprobs within the tolerance."""
    path = family_model(family)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    with LLM(path, multiprocess=False) as llm:
        output = llm.generate(FAMILY_PROMPTS[:1], params, use_tqdm=False)[0]
    completion = output.outputs[0]
    reference = hf_generate_logprobs(load_hf(path), output.prompt_token_ids, completion.token_ids)
    _assert_sample_logprobs(completion, reference, HF_TOLERANCE)


def assert_served_as_llm_answers(path: str) -> None:
    """The openai client on `python -m coreserve serve` of `path`: a whole and a streamed completion, their text
    and logprobs the in-process LLM's bit for bit."""
    import openai
    from server_harness import API_KEY, running_server

    prompt, params = FAMILY_PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    with LLM(path, multiprocess=False) as llm:
        expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    asked = dict(model=path, prompt=prompt, max_tokens=16, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    with running_server("--api-key", API_KEY, model=path) as (base, _):
        with openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
            whole = client.completions.create(**asked)
            chunks = list(client.completions.create(**asked, stream=True))
    logprobs = [entry[token].logprob for token, entry in zip(expected.token_ids, expected.logprobs)]
    assert whole.choices[0].text == expected.text and whole.choices[0].logprobs.token_logprobs == logprobs
    streamed = [value for chunk in chunks if chunk.choices for value in chunk.choices[0].logprobs.token_logprobs]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text and streamed == logprobs


@pytest.mark.parametrize("family", ["olmo2", "olmo3", "smollm3", "exaone4", "gemma4", "gpt_oss"])
def test_new_family_through_the_server(family, family_model):
    assert_served_as_llm_answers(family_model(family))


LONGROPE_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=3)


@pytest.mark.parametrize(
    "family, can_use_cpu_kernels", [("phi3.5", True), ("phi3.5", False), ("phi4-mini", True), ("phi4-mini", False)]
)
def test_phi3_longrope_factors_are_chosen_per_request_as_hf(family, can_use_cpu_kernels, family_model):
    """LongRoPE, original_max_position_embeddings scaled down to 32, as HF's Phi-3 computes it: prompts
    of 57-67 tokens rotate every position with the long factors (HF's forward over them, and its
    generate); a 20-token prompt takes the short ones, and where its 24 tokens cross 32 it is computed
    again from its start with the long ones (HF's generate drops its cache there). Each alone, then all
    in one batch, in 16-token chunks, the short prompt the start of a long one (the prefix cache must
    keep the two rotations apart); on the C kernels a request's bits do not depend on the batch.
    Phi-4-mini's partial rotary: the first 12 of each 16-wide head rotate."""
    path = family_model(family)
    with LLM(path, multiprocess=False, max_num_batched_tokens=16, can_use_cpu_kernels=can_use_cpu_kernels) as llm:
        long_prompts = [out.prompt_token_ids for out in llm.generate(FAMILY_PROMPTS[:3], LONGROPE_PARAMS, use_tqdm=False)]
        prompts = [{"prompt_token_ids": long_prompts[0][:20]}] + [{"prompt_token_ids": p} for p in long_prompts]
        alone = [llm.generate([prompt], LONGROPE_PARAMS, use_tqdm=False)[0] for prompt in prompts]
        batched = llm.generate(prompts, LONGROPE_PARAMS, use_tqdm=False)
    hf = load_hf(path)
    tolerance = HF_TOLERANCE if can_use_cpu_kernels else HF_TOLERANCE_TORCH_PATH
    assert [len(output.prompt_token_ids) > 32 for output in alone] == [False, True, True, True]
    for output in alone + batched:
        prompt, completion = output.prompt_token_ids, output.outputs[0]
        _assert_prompt_logprobs(output, hf_logprobs(hf, prompt), tolerance)
        _assert_sample_logprobs(completion, hf_generate_logprobs(hf, prompt, completion.token_ids), tolerance)
    if can_use_cpu_kernels:  # batch invariant: the same bits (the torch path: within the tolerance)
        for one, many in zip(alone, batched):
            assert sampled_rows(one) == sampled_rows(many) and one.prompt_logprobs == many.prompt_logprobs


@pytest.mark.parametrize("method", ["multi-step", "draft_model"])
def test_phi3_longrope_crossing_in_windows_and_proposals_matches_hf_generate(method, family_model):
    """A 20-token prompt's generation crosses LongRoPE's switch (32) where a 5-step window or a round of
    4 proposals (the model drafting for itself: every one kept) would run past it: the window and the
    proposals stop at the crossing, and the tokens after it come from the sequence computed again with
    the long factors, as HF's generate."""
    path = family_model("phi3.5")
    engine_args = (
        dict(num_scheduler_steps=5)
        if method == "multi-step"
        else dict(speculative_config={"model": path, "num_speculative_tokens": 4})
    )
    with LLM(path, multiprocess=False, **engine_args) as llm:
        output = llm.generate([{"prompt_token_ids": list(range(100, 120))}], LONGROPE_PARAMS, use_tqdm=False)[0]
        if method == "draft_model":
            assert llm.get_engine_stats().spec_num_accepted_tokens >= 12
    completion = output.outputs[0]
    reference = hf_generate_logprobs(load_hf(path), output.prompt_token_ids, completion.token_ids)
    _assert_sample_logprobs(completion, reference, HF_TOLERANCE)
