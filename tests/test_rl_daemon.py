"""The RL control through an attached daemon (`python -m coreserve.engine_core`, a real process on a real socket):
new weights from a trainer's tensors through the frontend's /dev/shm file, pause, resume, sleep,
wake, prefix-cache reset and the weight version, as through a spawned core; the core's own phases
come back with the update's reply."""

from __future__ import annotations

import pytest
import torch
from conftest import HF_TOLERANCE, running_daemon
from rl_checks import hf_scored, perturbed_hf

from coreserve import LLM
from coreserve.protocol.messages import UpdateWeights
from coreserve.protocol.sampling_params import SamplingParams

PROMPT = "The capital of France is Paris. The capital of Germany is"
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def scored(llm: LLM) -> torch.Tensor:
    out = llm.generate([PROMPT], SCORE, use_tqdm=False)[0]
    return torch.tensor([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])


@pytest.fixture(scope="module")
def attached(tiny_path, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('rl-daemon')}/core"
    with running_daemon(tiny_path, address, "--num-threads", "1", "--log-level", "ERROR"):
        with LLM(tiny_path, core_address=address) as llm:
            yield llm


def test_an_update_through_a_daemon_serves_the_new_weights_and_advances_the_version(attached, tiny_path):
    model = perturbed_hf(tiny_path, seed=31)
    version = attached.update_weights(model.named_parameters())
    assert version == attached.get_weight_version() == 1
    token_ids = attached.get_tokenizer().encode(PROMPT)
    assert torch.allclose(scored(attached), hf_scored(model, token_ids), atol=HF_TOLERANCE)
    assert attached.generate([PROMPT], GREEDY, use_tqdm=False)[0].weight_version == 1
    timings = attached.engine.last_update_timings
    assert {"write", "wire", "load", "derive", "reset_prefix_cache", "total"} <= timings.keys()
    assert all(value >= 0 for value in timings.values())


def test_a_mismatched_update_through_a_daemon_leaves_the_old_weights_serving(attached, tiny_path):
    before, version = scored(attached), attached.get_weight_version()
    model = perturbed_hf(tiny_path, seed=32)
    weights = list(model.named_parameters()) + [("model.layers.0.self_attn.k_proj.weight", torch.ones(5, 5))]
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        attached.update_weights(weights)
    assert attached.get_weight_version() == version
    assert torch.equal(scored(attached), before)


def test_pause_resume_sleep_wake_and_reset_through_a_daemon(attached):
    reference = attached.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    attached.pause_generation("wait")
    assert attached.engine.control_state().is_paused
    attached.resume_generation()
    attached.sleep(1)
    assert attached.is_sleeping()
    attached.wake_up()
    assert not attached.is_sleeping()
    attached.generate([PROMPT * 4], GREEDY, use_tqdm=False)  # full blocks for the prefix cache
    assert attached.get_engine_stats().num_cached_blocks > 0
    attached.reset_prefix_cache()
    assert attached.get_engine_stats().num_cached_blocks == 0
    assert attached.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference


def test_a_file_the_daemons_machine_lacks_is_refused_naming_the_host_rule(attached):
    """What a daemon on another host answers when sent the frontend's /dev/shm file: it is not there."""
    version = attached.get_weight_version()
    missing = "/dev/shm/coreserve-weights-not-here/model.safetensors"
    with pytest.raises(ValueError, match="daemon on another host cannot read them"):
        attached.engine._control(UpdateWeights(next(attached.engine._nonces), missing))
    assert attached.get_weight_version() == version
