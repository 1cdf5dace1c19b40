"""Hybrid models (recurrent layers beside attention): a random `Qwen3_5ForCausalLM` (a Gated DeltaNet layer,
then an output-gated attention layer), a random `Qwen3NextForCausalLM` (the same layers over experts), a
random `Lfm2ForCausalLM` (a short convolution layer, then attention) and a random `GraniteMoeHybridForCausalLM`
(a Mamba2 layer, then NoPE attention, with Granite's multipliers) against Hugging Face transformers; the
invariants on the state cache (alone = batched, scoring = generation, chunk size, preemption, n > 1,
prefix-cache hits from state snapshots, multi-step windows); a hub folder's vision-language layout; the C
mixers against torch's; what is refused.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from conftest import (
    HF_TOLERANCE,
    HF_TOLERANCE_TORCH_PATH,
    IS_BF16_MODE,
    TEST_DTYPE,
    hf_logprobs,
    load_hf,
    stream_then_abort,
)
from safetensors.torch import load_file, save_file
from test_batch_invariance import sampled_rows, scoring_mismatches
from test_model_families import (
    FAMILY_PROMPTS,
    _assert_prompt_logprobs,
    _assert_sample_logprobs,
    assert_served_as_llm_answers,
    hf_generate_logprobs,
)

from coreserve import LLM, AsyncLLM, SamplingParams
from coreserve.worker.models.config import DecoderArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=3)
SAMPLED = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True, logprobs=5)
# 16-token chunks; 8 blocks of 16 cannot hold five ~70-token sequences: chunked prefill and preemption
CHUNKED = dict(max_num_batched_tokens=16, num_kv_blocks=8, block_size=16)
HYBRID_FAMILIES = ["qwen3_5", "lfm2", "qwen3_next", "granitemoehybrid"]
BF16_TOLERANCE = 0.75  # measured 0.50 on the C path (Qwen3's 0.09): docs/models.md


@pytest.mark.parametrize("family, multiprocess, engine_args", [
    ("qwen3_5", False, CHUNKED),
    ("qwen3_5", False, dict(max_num_batched_tokens=512, can_use_cpu_kernels=False)),  # torch's mixer
    ("lfm2", True, CHUNKED),
    pytest.param(  # its checkpoint's grouped projections, experts beside a gated shared one
        "qwen3_next", True, CHUNKED,
        marks=pytest.mark.fp32_exact("bf16 routing flips near-ties against fp32 HF (as tests/test_moe.py's)"),
    ),
    ("granitemoehybrid", False, CHUNKED),
])
def test_hybrid_matches_hf(family, multiprocess, engine_args, family_model):
    """Prompt logprobs against HF's forward (which runs Qwen3.5's recurrence over a prompt in chunks) and
    generation against its `generate` (token by token from its cache), chunked and preempted."""
    path = family_model(family)
    with LLM(path, multiprocess=multiprocess, **engine_args) as llm:
        outputs = llm.generate(FAMILY_PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.get_engine_stats()
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0
    # conv (+ recurrent) states: Granite's conv over x, B and C (64 + 2 x 2 x 16), a [16, 16] state a head
    gated_deltanet_state = 4 * (128 * 3 + 4 * 16 * 16)
    state_bytes = {"qwen3_5": gated_deltanet_state, "qwen3_next": gated_deltanet_state, "lfm2": 4 * 2 * 64,
                   "granitemoehybrid": 4 * (128 * 3 + 4 * 16 * 16)}
    assert stats.num_state_slots > 0 and stats.state_bytes_per_seq == state_bytes[family]
    hf = load_hf(path)
    tolerance = HF_TOLERANCE if engine_args.get("can_use_cpu_kernels", True) else HF_TOLERANCE_TORCH_PATH
    if IS_BF16_MODE:  # bf16 products round the activations, and the recurrence carries that on (docs/models.md)
        tolerance = BF16_TOLERANCE
    for output in outputs:
        prompt, completion = output.prompt_token_ids, output.outputs[0]
        assert len(completion.token_ids) == 16
        _assert_prompt_logprobs(output, hf_logprobs(hf, prompt), tolerance)
        if not IS_BF16_MODE:  # bf16: the prompt rows' relative bound; generate's rows are fp32 HF's
            _assert_sample_logprobs(completion, hf_generate_logprobs(hf, prompt, completion.token_ids), tolerance)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_alone_equals_batched_and_scoring_equals_generation(family, family_model):
    """Each prompt alone in whole-prompt steps, then all in one batch in 16-token chunks (other lengths
    beside each), then every generated sequence scored: the recurrence runs token by token both ways."""
    params = [GREEDY if i % 2 == 0 else SAMPLED for i in range(len(FAMILY_PROMPTS))]
    path = family_model(family)
    with LLM(path, multiprocess=False, max_num_batched_tokens=512) as llm:
        alone = [llm.generate([prompt], p, use_tqdm=False)[0] for prompt, p in zip(FAMILY_PROMPTS, params)]
    with LLM(path, multiprocess=False, max_num_batched_tokens=16) as llm:
        batched = llm.generate(FAMILY_PROMPTS, params, use_tqdm=False)
        assert [scoring_mismatches(llm, out) for out in batched] == [0] * len(batched)
    for one, many in zip(alone, batched):
        assert sampled_rows(one) == sampled_rows(many)
        assert one.prompt_logprobs == many.prompt_logprobs


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_request_through_preemption_n4_prefix_hits_and_windows(family, family_model):
    """One request's bits (sample and prompt logprobs): alone with no prefix cache; then from the cache
    (its state restored from the snapshot at the last boundary its prompt passed: 48 tokens, every 3
    blocks for Qwen3.5's state here, every block for LFM2's), as each of n = 4 greedy children; beside
    four long requests in a KV cache too small for them (preempted: computed again, its state slot given
    back and taken anew); in multi-step windows. Granite's state is every 3 blocks too."""
    path = family_model(family)
    prompt = FAMILY_PROMPTS[0]
    with LLM(path, multiprocess=False, enable_prefix_caching=False) as llm:
        plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert len(plain.prompt_token_ids) > 48
    with LLM(path, multiprocess=False, max_num_batched_tokens=40) as llm:
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        warm = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        children = llm.generate([prompt], SamplingParams(**{**_fields(GREEDY), "n": 4}), use_tqdm=False)[0]
        stats = llm.get_engine_stats()
    assert warm.num_cached_tokens == children.num_cached_tokens == 48 and stats.num_state_snapshots >= 1
    assert len(children.outputs) == 4 and children.prompt_logprobs == plain.prompt_logprobs
    for child in children.outputs:
        assert [(t, e) for t, e in zip(child.token_ids, child.logprobs)] == list(
            zip(plain.outputs[0].token_ids, plain.outputs[0].logprobs))
    with LLM(path, multiprocess=False, **CHUNKED) as llm:
        crowded = llm.generate(FAMILY_PROMPTS[1:4] + [prompt], GREEDY, use_tqdm=False)[3]
        assert llm.get_engine_stats().num_preemptions > 0
    with LLM(path, multiprocess=False, num_scheduler_steps=4) as llm:
        windowed = llm.generate([prompt, FAMILY_PROMPTS[1]], GREEDY, use_tqdm=False)[0]
    for other in (first, warm, crowded, windowed):
        assert sampled_rows(other) == sampled_rows(plain) and other.prompt_logprobs == plain.prompt_logprobs


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid"])
def test_an_aborted_hybrid_request_gives_its_state_back_and_the_next_gets_the_plain_bits(family, family_model):
    """A long request aborted mid-stream, then the plain request on the same engine: its state slot and blocks
    are back (nothing left running, every KV block free) and the next request's bits are a fresh engine's."""
    path, prompt = family_model(family), FAMILY_PROMPTS[0]
    with LLM(path, multiprocess=False) as llm:
        plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0]

    async def abort_then_plain(engine) -> tuple[list, list]:
        long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        aborted = await stream_then_abort(engine, long, "to-abort")
        return aborted, [delta async for delta in engine.generate(prompt, GREEDY, "after")]

    with AsyncLLM(path, multiprocess=False, num_kv_blocks=64) as engine:
        aborted, deltas = asyncio.run(abort_then_plain(engine))
        core = engine.engine.client.core
        assert not core.has_unfinished_requests() and core.kv_cache.num_free_blocks == core.num_kv_blocks
    assert aborted[-1].finished and aborted[-1].outputs[0].finish_reason == "abort"
    tokens = [t for d in deltas for t in d.outputs[0].token_ids]
    entries = [e for d in deltas for e in d.outputs[0].logprobs]
    assert [(t, [(i, e.logprob, e.rank) for i, e in entry.items()]) for t, entry in zip(tokens, entries)] == (
        sampled_rows(plain))
    assert deltas[0].prompt_logprobs == plain.prompt_logprobs


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def test_qwen3_5_hub_layout_gives_the_same_bits(family_model, tmp_path):
    """A hub folder's layout (`Qwen3_5ForConditionalGeneration`): the decoder's config in text_config, its
    tensors under model.language_model., a vision tower and a multi-token-prediction head skipped by
    name: the bits of the text-only folder."""
    source = Path(family_model("qwen3_5"))
    for item in source.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            (tmp_path / item.name).symlink_to(item)
    text = json.loads((source / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1},
              "tie_word_embeddings": False}
    del config["text_config"]["architectures"], config["text_config"]["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in
               load_file(str(source / "model.safetensors")).items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    prompts = FAMILY_PROMPTS[:2]
    with LLM(str(source), multiprocess=False) as llm:
        expected = llm.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(str(tmp_path), multiprocess=False) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    for one, other in zip(expected, got):
        assert sampled_rows(one) == sampled_rows(other) and one.prompt_logprobs == other.prompt_logprobs


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid"])
def test_c_mixer_equals_torch_and_its_own_token_by_token(family, family_model):
    """csrc/recurrent_mixers.c against the torch reference (gated_deltanet_span, mamba2_span) on the test
    model's first layer: within float rounding; and a span in one call = its tokens one call each, bit for
    bit (the conv state too)."""
    from coreserve.worker.cpu.kernels import gated_deltanet, load_cpu_kernels, mamba2
    from coreserve.worker.models.gated_deltanet import LayerState
    from coreserve.worker.models.loader import load_model
    from coreserve.worker.models.ops import TorchOps
    from coreserve.worker.step.attention import StateSpan

    model = load_model(family_model(family), torch.float32, torch.device("cpu"))
    layer = model.layers[0]
    mixer = layer.linear_attn or layer.mamba
    is_mamba = layer.mamba is not None
    c_mixer, torch_mixer = (mamba2, TorchOps().mamba2) if is_mamba else (gated_deltanet, TorchOps().gated_deltanet)
    lin = mixer.shape
    recurrent = ((lin.num_heads, lin.head_dim, lin.state_size) if is_mamba
                 else (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim))
    torch.manual_seed(0)
    proj = torch.randn(23, mixer.in_proj.out_features)

    def states() -> LayerState:
        return LayerState(torch.zeros(2, lin.conv_kernel - 1, lin.conv_dim), torch.zeros(2, *recurrent))

    kernels = load_cpu_kernels()
    whole_state, steps_state, torch_state = states(), states(), states()
    whole = c_mixer(kernels, mixer, proj, whole_state, [StateSpan(0, 23, 1)])
    steps = torch.cat([c_mixer(kernels, mixer, proj[t : t + 1].contiguous(), steps_state, [StateSpan(0, 1, 1)])
                       for t in range(23)])
    reference = torch_mixer(mixer, proj, torch_state, [StateSpan(0, 23, 1)])
    assert torch.equal(whole, steps) and torch.equal(whole_state.recurrent, steps_state.recurrent)
    assert torch.equal(whole_state.conv, steps_state.conv) and torch.allclose(whole_state.conv, torch_state.conv)
    assert torch.allclose(whole, reference, atol=1e-5, rtol=1e-4)
    assert torch.allclose(whole_state.recurrent, torch_state.recurrent, atol=1e-5, rtol=1e-4)
    assert not whole_state.recurrent[0].any()  # the other slot untouched


@pytest.mark.parametrize("engine_args, message", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size > 1 with a hybrid model"),
    (dict(enable_lora=True), "LoRA"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
])
def test_what_a_hybrid_does_not_do_yet_is_refused_by_name(engine_args, message, family_model):
    with pytest.raises(Exception, match=message):
        LLM(family_model("qwen3_5"), multiprocess=False, **engine_args)


def test_hybrid_config_checks(family_model):
    config = json.loads((Path(family_model("qwen3_5")) / "config.json").read_text())
    args = DecoderArgs.from_hf_config(config)
    assert [s.mixer for s in args.layers] == ["gated_deltanet", "attention"] and args.is_hybrid
    for change, message in [
        ({"layer_types": ["linear_attention"]}, "layer_types must list"),
        ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
        ({"linear_num_value_heads": 3}, "multiple of"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ({"architectures": ["Qwen3_5ForConditionalGeneration"]}, "text_config"),
    ]:
        with pytest.raises(ValueError, match=message):
            DecoderArgs.from_hf_config({**config, **change})
    no_types = {k: v for k, v in config.items() if k != "layer_types"} | {"num_hidden_layers": 8}
    kinds = [s.mixer for s in DecoderArgs.from_hf_config(no_types).layers]
    assert kinds == ["gated_deltanet"] * 3 + ["attention"] + ["gated_deltanet"] * 3 + ["attention"]
    # a shared expert: Qwen3-Next's, sized; refused by name where the family has none (Qwen3-MoE)
    moe = json.loads((Path(family_model("qwen3_next")) / "config.json").read_text())
    assert DecoderArgs.from_hf_config(moe).moe.shared_intermediate_size == 48
    bare = DecoderArgs.from_hf_config({k: v for k, v in moe.items() if k not in ("norm_topk_prob", "head_dim")})
    assert bare.moe.norm_topk_prob and bare.head_dim == 256  # HF's Qwen3NextConfig defaults, where absent
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        DecoderArgs.from_hf_config({**moe, "shared_expert_intermediate_size": 0})
    qwen3_moe = json.loads((Path(family_model("qwen3_moe")) / "config.json").read_text())
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=48"):
        DecoderArgs.from_hf_config({**qwen3_moe, "shared_expert_intermediate_size": 48})


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_through_the_server(family, family_model):
    """The openai client on `python -m coreserve serve` of each random hybrid: a streamed and a whole
    completion, their logprobs LLM's."""
    assert_served_as_llm_answers(family_model(family))


def test_lfm2_config_reading(family_model):
    """LFM2's MLP width as HF adjusts it, its layer kinds from full_attn_idxs too, and its checks."""
    config = json.loads((Path(family_model("lfm2")) / "config.json").read_text())
    args = DecoderArgs.from_hf_config(config)
    assert args.intermediate_size == 96 and [s.mixer for s in args.layers] == ["short_conv", "attention"]
    by_index = {k: v for k, v in config.items() if k != "layer_types"} | {"full_attn_idxs": [1]}
    assert DecoderArgs.from_hf_config(by_index).layers == args.layers
    assert DecoderArgs.from_hf_config({**config, "block_auto_adjust_ff_dim": False}).intermediate_size == 128
    older = {k: v for k, v in config.items() if k not in ("intermediate_size", "tie_word_embeddings")}
    older |= {"block_ff_dim": 128, "tie_embedding": False}  # LFM2's hub configs' names, as HF reads them
    assert DecoderArgs.from_hf_config(older).intermediate_size == 96
    assert not DecoderArgs.from_hf_config(older).tie_word_embeddings
    for change, message in [({"conv_L_cache": 1}, "conv_L_cache"), ({"block_multiple_of": 0}, "block_multiple_of")]:
        with pytest.raises(ValueError, match=message):
            DecoderArgs.from_hf_config({**config, **change})


@pytest.mark.parametrize("family", HYBRID_FAMILIES)  # Qwen3-Next: its grouped in_proj rows as at load
def test_hybrid_after_sleep_wake_and_new_weights_gives_a_fresh_engines_bits(family, family_model, tmp_path):
    """An engine that served (its prefix cache and state snapshots filled), slept, woke and took new
    weights answers with the bits of an engine started on those weights: no state, snapshot or cached
    block of the old weights is read."""
    from rl_checks import perturbed_hf

    path = family_model(family)
    source, prompts = Path(path), FAMILY_PROMPTS[:3]
    hf = perturbed_hf(path, seed=3)  # in fp32: saved in the folder's own dtype, as a trainer would send it
    hf.to(getattr(torch, TEST_DTYPE)).save_pretrained(str(tmp_path))
    for item in source.iterdir():
        if not (tmp_path / item.name).exists():
            (tmp_path / item.name).symlink_to(item)
    with LLM(path, multiprocess=False, max_num_batched_tokens=40) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.get_engine_stats().num_state_snapshots > 0
        llm.sleep(1)
        llm.wake_up()
        llm.update_weights(load_file(str(tmp_path / "model.safetensors")).items())  # the names HF saves
        updated = llm.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(str(tmp_path), multiprocess=False, max_num_batched_tokens=40) as llm:
        fresh = llm.generate(prompts, GREEDY, use_tqdm=False)
    for one, other in zip(updated, fresh):
        assert sampled_rows(one) == sampled_rows(other) and one.prompt_logprobs == other.prompt_logprobs
