"""generation_config.json: every EOS id it lists stops generation; its sampling defaults are
`LLM.get_default_sampling_params()` and apply when generate gets no SamplingParams, never over the
user's (coreserve/protocol/model_facts.py, coreserve/frontend/llm.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import FAMILY_PROMPTS_SHORT

from coreserve import LLM, AsyncLLM, SamplingParams
from coreserve.protocol.model_facts import eos_token_ids, generation_defaults


def _with_generation_config(source: str, folder: Path, generation_config: dict) -> str:
    """The same weights, config and tokenizer (links) with another generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in Path(source).iterdir():
        if item.name != "generation_config.json":
            (folder / item.name).symlink_to(item)
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return str(folder)


@pytest.fixture(scope="module")
def greedy_tokens(family_model) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(family_model("llama2"), multiprocess=False) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(FAMILY_PROMPTS_SHORT, params, use_tqdm=False)]


def test_every_eos_id_of_generation_config_stops(family_model, greedy_tokens, tmp_path):
    """Two prompts whose greedy outputs reach two different tokens: both listed as EOS, each stops."""
    first, second = greedy_tokens
    stops = [
        next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 2) for tokens in (first, second)
    ]
    eos = [first[stops[0]], second[stops[1]]]
    assert eos[0] not in second[: stops[1] + 1] and eos[1] not in first[: stops[0] + 1]
    path = _with_generation_config(family_model("llama2"), tmp_path / "m", {"eos_token_id": eos})
    assert eos_token_ids(path) == [2, *eos]  # config.json's own first
    with LLM(path, multiprocess=False) as llm:
        outputs = llm.generate(
            FAMILY_PROMPTS_SHORT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )
    for output, tokens, stop in zip(outputs, (first, second), stops):
        assert output.outputs[0].token_ids == tokens[: stop + 1]
        assert output.outputs[0].finish_reason == "stop"


def test_defaults_come_from_generation_config_and_never_override_the_users(family_model, tmp_path):
    config = {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
              "max_new_tokens": 5, "bos_token_id": 1}
    path = _with_generation_config(family_model("llama2"), tmp_path / "m", config)
    assert generation_defaults(path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 5}
    with LLM(path, multiprocess=False) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (
            0.6,
            0.9,
            20,
            5,
        )
        assert defaults.min_p == SamplingParams().min_p and defaults.repetition_penalty == 1.0
        implicit = llm.generate(FAMILY_PROMPTS_SHORT, use_tqdm=False)
        explicit = llm.generate(
            FAMILY_PROMPTS_SHORT, SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False
        )
    assert all(len(o.outputs[0].token_ids) == 5 for o in implicit)
    assert all(len(o.outputs[0].token_ids) == 9 for o in explicit)
    with AsyncLLM(path, multiprocess=False) as engine:  # the same defaults for the async API
        assert engine.get_default_sampling_params() == defaults

        async def stream() -> int:
            return sum([len(o.outputs[0].token_ids) async for o in engine.generate(FAMILY_PROMPTS_SHORT[0])])

        assert asyncio.run(stream()) == 5


def test_no_generation_config_means_vllms_defaults(tiny_path):
    assert generation_defaults(tiny_path) == {}
