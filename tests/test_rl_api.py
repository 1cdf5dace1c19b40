"""The RL control through the Python API (coreserve/frontend/engine/engine.py, coreserve/frontend/control_verbs.py) across the real process boundary, on the
built-in model: LLM with a spawned core and with TP=2 ranks, AsyncLLM with its streamed deltas."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import HF_TOLERANCE, load_hf
from rl_checks import hf_scored, perturb
from safetensors.torch import save_file

from coreserve import LLM, AsyncLLM
from coreserve.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
PROMPT = "The capital of France is Paris. The capital of Germany is"


def scored(llm: LLM) -> torch.Tensor:
    out = llm.generate([PROMPT], SCORE)[0]
    return torch.tensor([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])


@pytest.fixture(scope="module")
def llm(tiny_path):
    with LLM(tiny_path, num_kv_blocks=64) as llm:
        yield llm


def test_update_weights_from_named_parameters_across_the_process_boundary(llm, tiny_path):
    hf = load_hf(tiny_path)
    token_ids = llm.get_tokenizer().encode(PROMPT)
    perturb(hf, seed=5)
    version = llm.update_weights(hf.named_parameters())
    assert version == llm.get_weight_version() >= 1
    assert torch.allclose(scored(llm), hf_scored(hf, token_ids), atol=HF_TOLERANCE)
    assert llm.generate([PROMPT], GREEDY)[0].weight_version == version


def test_a_mismatched_update_through_the_api_is_a_value_error_and_changes_nothing(llm, tiny_path, tmp_path):
    before, version = scored(llm), llm.get_weight_version()
    bad = tmp_path / "bad.safetensors"
    save_file({"model.norm.weight": torch.ones(7)}, str(bad))
    with pytest.raises(ValueError, match="model.norm.weight"):
        llm.check_weights(bad)  # the check alone (what several engines run before any updates)
    llm.check_weights(f"{tiny_path}/model.safetensors")
    hf = load_hf(tiny_path)
    perturb(hf, seed=6)
    weights = list(hf.named_parameters()) + [("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2))]
    with pytest.raises(ValueError, match="up_proj"):
        llm.update_weights(weights)
    with pytest.raises(ValueError, match="mode"):
        llm.update_weights(hf.named_parameters(), mode="later")
    assert llm.get_weight_version() == version and torch.equal(scored(llm), before)


def test_pause_sleep_and_wake_through_the_api(llm):
    reference = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    llm.pause_generation("abort")
    llm.resume_generation()
    llm.sleep(1)
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    llm.reset_prefix_cache()
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == reference
    with pytest.raises(ValueError, match="level"):
        llm.sleep(3)
    assert llm.get_engine_stats().num_free_kv_blocks == llm.get_engine_stats().num_kv_blocks


def test_async_llm_updates_and_every_streamed_delta_carries_the_version(tiny_path):
    hf = load_hf(tiny_path)
    perturb(hf, seed=7)

    async def main() -> list[int]:
        with AsyncLLM(tiny_path, num_kv_blocks=64) as engine:
            await engine.check_weights(f"{tiny_path}/model.safetensors")  # a check only: no new version
            with pytest.raises(ValueError, match="does not exist"):
                await engine.check_weights(f"{tiny_path}/absent.safetensors")
            assert (await engine.control_state()).weight_version == 0
            version = await engine.update_weights(hf.named_parameters())
            await engine.pause_generation("keep")
            await engine.resume_generation()
            versions = [d.weight_version async for d in engine.generate(PROMPT, GREEDY, "r")]
            return [version, *versions]

    version, *deltas = asyncio.run(main())
    assert version == 1 and deltas and set(deltas) == {1}


def test_tensor_parallel_ranks_all_load_the_update(tiny_path):
    hf = load_hf(tiny_path)
    token_ids = None
    perturb(hf, seed=8)
    with LLM(tiny_path, tensor_parallel_size=2, num_threads=1, num_kv_blocks=64) as llm:
        token_ids = llm.get_tokenizer().encode(PROMPT)
        assert llm.update_weights(hf.named_parameters()) == 1
        assert torch.allclose(scored(llm), hf_scored(hf, token_ids), atol=HF_TOLERANCE)
        with pytest.raises(ValueError, match="shape"):
            llm.update_weights([("model.layers.0.self_attn.q_proj.weight", torch.ones(3, 3))])
        assert torch.allclose(scored(llm), hf_scored(hf, token_ids), atol=HF_TOLERANCE)
