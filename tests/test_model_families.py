"""Each supported family (Llama 2, 3.1, 3.2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, Qwen3-MoE,
Mixtral, OLMoE) against Hugging Face transformers on the same random weights: greedy tokens, sample and
prompt logprobs, past the RoPE thresholds and the sliding window, with chunked prefill and preemption
forced; batch invariance for the families added since the first (alone = batched, scoring = generation);
config keys the engine cannot honour refused. The routed experts: test_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import HF_TOLERANCE, HF_TOLERANCE_TORCH_PATH, IS_BF16_MODE, hf_logprobs, load_hf
from test_batch_invariance import sampled_rows, scoring_mismatches

from frontend import LLM, SamplingParams
from worker.models.config import LlamaArgs

MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
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
    # and each family in the other process mode too
    ("llama2", False, CHUNKED),
    ("llama3.1", True, CHUNKED),
    ("llama3.2", True, CHUNKED),
    ("qwen2", True, CHUNKED),
    ("qwen3", False, CHUNKED),
    ("phi3", True, CHUNKED),
    ("qwen3_moe", False, CHUNKED),  # mixtures of experts: routed per token, chunked and preempted
    ("mixtral", True, CHUNKED),
    ("olmoe", False, CHUNKED),
    ("qwen3_moe", True, dict(max_num_batched_tokens=512, can_use_cpu_kernels=False)),  # torch's ops
    ("gemma2", False, CHUNKED),  # soft-caps, sandwich norms, local and global layers
    ("gemma2", True, dict(max_num_batched_tokens=512, can_use_cpu_kernels=False)),  # torch's ops
    ("gemma3", True, CHUNKED),  # two RoPE tables, q/k norms
    ("gemma3", False, dict(max_num_batched_tokens=512, can_use_cpu_kernels=False)),
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


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3", "qwen3_moe", "mixtral", "olmoe"])
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
    new = LlamaArgs.from_hf_config(config)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = dict(rope, type=rope.pop("rope_type"))
    assert LlamaArgs.from_hf_config(config) == new
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
        LlamaArgs.from_hf_config({**config, **change})


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


def hf_logprobs_decoded(model, token_ids: list[int]):
    """[len(token_ids), vocab] float64 log_softmax of HF's logits, one token at a time with its KV cache:
    LongRoPE's frequencies chosen per step by the positions so far (HF's generation), not once for the
    whole sequence as a single forward would."""
    import torch

    rows, past = [], None
    with torch.no_grad():
        for token in token_ids:
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            rows.append(out.logits[0, -1])
    return torch.log_softmax(torch.stack(rows).double(), dim=-1)


@pytest.mark.parametrize("family, can_use_cpu_kernels", [("phi3.5", True), ("phi4-mini", True), ("phi4-mini", False)])
def test_phi3_longrope_across_the_switch_matches_hf_decoding_with_its_cache(family, can_use_cpu_kernels, family_model):
    """Phi-3.5's LongRoPE, original_max_position_embeddings scaled down to 32: prompts of 40-70 tokens
    cross it. Below it the short factors, from it the long ones, per position (as HF's decoding with a
    KV cache; HF's single forward over a sequence past 32 would rotate every position with the long).
    Phi-4-mini's partial rotary: the first 12 of each 16-wide head rotate, on the C kernels and on torch's."""
    path = family_model(family)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    with LLM(path, multiprocess=False, max_num_batched_tokens=16, can_use_cpu_kernels=can_use_cpu_kernels) as llm:
        outputs = llm.generate(FAMILY_PROMPTS[:3], params, use_tqdm=False)
    hf = load_hf(path)
    tolerance = HF_TOLERANCE if can_use_cpu_kernels else HF_TOLERANCE_TORCH_PATH
    for output in outputs:
        completion = output.outputs[0]
        reference = hf_logprobs_decoded(hf, output.prompt_token_ids + completion.token_ids)
        start = len(output.prompt_token_ids) - 1
        assert start > 32
        for step, (token_id, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[start + step]
            assert row[token_id] >= row.max() - tolerance
            for entry_id, logprob in entries.items():
                assert abs(logprob.logprob - row[entry_id].item()) < tolerance
        _assert_prompt_logprobs(output, reference, tolerance)
