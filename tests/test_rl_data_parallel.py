"""update_weights behind one frontend with several daemons (coreserve/frontend/clients/multi_core_control.py): every core
takes the update and the versions stay in step; an update one core refuses is refused by all (each
checks before any copies), and versions that came apart are an error naming them. The policy itself
(`update_all_or_none`, Ray Serve's too) on stand-in engines first."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from conftest import HF_TOLERANCE, running_daemon
from rl_checks import hf_scored, perturbed_hf

from coreserve import LLM
from coreserve.frontend.clients.multi_core_control import update_all_or_none
from coreserve.protocol.builtin_model import PRESETS, ensure_model
from coreserve.protocol.messages import GetControlState
from coreserve.protocol.sampling_params import SamplingParams

PROMPTS = ["The capital of France is Paris. The capital of Germany is", "Once upon a time there was"]
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
DAEMON_FLAGS = ("--num-threads", "1", "--log-level", "ERROR")


def core_versions(llm: LLM) -> list[int]:
    return [
        core.control(GetControlState(10_000 + i)).weight_version for i, core in enumerate(llm.client.cores)
    ]


def scores(llm: LLM) -> list[torch.Tensor]:
    outs = llm.generate(PROMPTS, SCORE, use_tqdm=False)  # one prompt per core (the fewest in flight)
    return [torch.tensor([next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]]) for o in outs]


class StandIn:
    """An engine whose update is all or none by itself: `refuses` at the check, `fails` after it."""

    def __init__(self, refuses: str | None = None, fails: str | None = None) -> None:
        self.refuses, self.fails, self.version, self.applies = refuses, fails, 0, 0

    def check(self) -> str | None:
        return self.refuses

    def apply(self) -> str | None:
        self.applies += 1
        if self.fails is None:
            self.version += 1
        return self.fails


def run_policy(engines: list[StandIn]):
    return update_all_or_none(lambda: [e.check() for e in engines], lambda: [e.apply() for e in engines],
                              lambda reply: reply)


def test_the_policy_applies_only_when_every_engine_accepts():
    engines = [StandIn(), StandIn(refuses="model.norm.weight has shape (7,)"), StandIn()]
    outcome = run_policy(engines)
    assert not outcome.applied and outcome.refused == [1] and not outcome.is_split
    assert outcome.replies[1] == "model.norm.weight has shape (7,)"
    assert [(e.version, e.applies) for e in engines] == [(0, 0)] * 3  # no engine was even asked to apply
    engines = [StandIn(), StandIn()]
    outcome = run_policy(engines)
    assert outcome.applied and outcome.refused == [] and [e.version for e in engines] == [1, 1]
    engines = [StandIn(), StandIn(fails="the file is gone")]  # a failure of its own, after every check
    outcome = run_policy(engines)
    assert outcome.is_split and outcome.refused == [1] and [e.version for e in engines] == [1, 0]


@pytest.fixture(scope="module")
def daemons(tiny_path, tmp_path_factory):
    """Two of the tiny model, and one of a model like it but two layers deep (same tokenizer, limits)."""
    spec = dataclasses.replace(PRESETS["tiny"], num_layers=2)
    shallow = ensure_model(spec, Path.home() / ".cache" / "coreserve" / "test-tiny-2-layers-v1")
    folder = tmp_path_factory.mktemp("rl-dp")
    addresses = {name: f"ipc://{folder}/{name}" for name in ("a", "b", "shallow")}
    with ExitStack() as stack:
        for name, address in addresses.items():
            stack.enter_context(
                running_daemon(shallow if name == "shallow" else tiny_path, address, *DAEMON_FLAGS)
            )
        yield addresses


def test_every_core_takes_the_update_and_the_versions_stay_in_step(daemons, tiny_path):
    with LLM(tiny_path, core_address=[daemons["a"], daemons["b"]]) as llm:
        model = perturbed_hf(tiny_path, seed=41)
        assert llm.update_weights(model.named_parameters()) == 1
        assert core_versions(llm) == [1, 1] and llm.get_weight_version() == 1
        outs = llm.generate(PROMPTS, SCORE, use_tqdm=False)
        assert {o.weight_version for o in outs} == {1}
        per_core = [core.get_stats().num_prefill_tokens for core in llm.client.cores]
        assert all(n > 0 for n in per_core)  # both cores answered, both on the new weights
        tokenizer = llm.get_tokenizer()
        for got, prompt in zip(scores(llm), PROMPTS):
            assert torch.allclose(got, hf_scored(model, tokenizer.encode(prompt)), atol=HF_TOLERANCE)
        with pytest.raises(ValueError, match="has shape"):
            llm.update_weights([("model.norm.weight", torch.ones(7))])
        assert core_versions(llm) == [1, 1]


def test_an_update_one_core_refuses_changes_no_core(daemons, tiny_path):
    """Core a (four layers) and the two-layer core: an update of layer 3 passes a's checks, not the
    other's. Both check first, so a keeps its weights and version. Their versions differ (a was
    updated apart from the other, by a frontend of its own): an error naming both."""
    last_layer = [(n, p) for n, p in perturbed_hf(tiny_path, seed=42).named_parameters()
                  if n.startswith("model.layers.3.")]
    with LLM(tiny_path, core_address=daemons["a"]) as alone:
        assert alone.update_weights(last_layer) >= 1
    with LLM(tiny_path, core_address=[daemons["a"], daemons["shallow"]]) as llm:
        before = core_versions(llm)
        scored_before = scores(llm)
        with pytest.raises(ValueError, match="model.layers.3.*not a weight of this model"):
            llm.update_weights(last_layer)
        assert core_versions(llm) == before
        assert all(torch.equal(a, b) for a, b in zip(scores(llm), scored_before))
        with pytest.raises(ValueError, match="weight versions differ"):
            llm.get_weight_version()
        llm.pause_generation("abort")  # the other commands go on
        llm.resume_generation()
        with pytest.raises(ValueError, match="applied on every core, but .* versions differ"):
            llm.update_weights([("model.norm.weight", torch.ones(256))])  # both models have it
        assert [v - b for v, b in zip(core_versions(llm), before)] == [1, 1]
