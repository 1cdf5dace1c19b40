"""The RL loop end to end on the real SmolLM2-135M: a trainer holds the HF model and takes policy-gradient
steps on a toy reward; the engine (a spawned core, then a daemon) generates with logprobs and gets the
new weights through `update_weights` after each step. After each update every generated token's logprob
equals the HF model's forward with the trainer's current weights (fp32), the weight version advances,
and every output of a step carries that step's version: no request sees mixed weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import IS_BF16_MODE, running_daemon

from frontend import LLM
from protocol.builtin_model import builtin_model_path, default_cache_dir
from protocol.gguf_header import read_gguf_header
from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(IS_BF16_MODE, reason="the 1e-4 claim is fp32's (the trainer's weights)")

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "My favourite colour is"]
TOLERANCE = 1e-4
ROLLOUT = SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, seed=11)


@pytest.fixture(scope="module")
def smollm2() -> str:
    return builtin_model_path("smollm2")


def hf_reference_folder(path: str) -> str:
    """transformers' GGUF loader's model of `path`, saved once as a folder (config, safetensors): the
    trainer starts from exactly the weights the engine dequantized."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    digest = read_gguf_header(path).tokenizer_digest
    folder = default_cache_dir() / "hf-reference" / f"{Path(path).stem}-{digest}-{os.path.getsize(path)}"
    if (folder / "model.safetensors").exists():
        return str(folder)
    model = AutoModelForCausalLM.from_pretrained(
        str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32
    )
    tmp = folder.with_name(folder.name + f".{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    tensors = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.rename(tmp, folder)
    return str(folder)


def trainer(smollm2: str):
    """The HF model, its last two layers and final norm trained (the rest frozen keeps a step cheap on
    a CPU; every weight still goes to the engine)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_reference_folder(smollm2), dtype=torch.float32)
    num_layers = model.config.num_hidden_layers
    trained = tuple(f"model.layers.{i}." for i in (num_layers - 2, num_layers - 1)) + ("model.norm.",)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(trained))
    return model


def completion_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """log p(completion token i | prefix) under `model`, with its gradient."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids).unsqueeze(1))[:, 0]


def reward(text: str) -> float:
    """Toy: the share of vowels in the completion."""
    return sum(c in "aeiou" for c in text) / max(1, len(text))


def policy_gradient_loop(llm: LLM, model, num_steps: int) -> list[int]:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    versions = []
    for step in range(num_steps):
        outs = llm.generate(PROMPTS, ROLLOUT)
        expected_version = versions[-1] if versions else 0
        assert {o.weight_version for o in outs} == {expected_version}  # one version for the whole step
        ours = [torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]  # fmt: skip
        model.eval()
        with torch.no_grad():
            theirs = [completion_logprobs(model, o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
        worst = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
        assert worst <= TOLERANCE, f"step {step}: engine vs the trainer's weights differ by {worst:.2e}"
        model.train()
        rewards = torch.tensor([reward(o.outputs[0].text) for o in outs])
        advantages = rewards - rewards.mean()
        optimizer.zero_grad()
        loss = -sum(
            adv * completion_logprobs(model, o.prompt_token_ids, o.outputs[0].token_ids).sum()
            for adv, o in zip(advantages, outs)
        )
        loss.backward()
        optimizer.step()
        with torch.no_grad():  # the step moved the policy: the old weights could not pass the next check
            moved = [
                completion_logprobs(model.eval(), o.prompt_token_ids, o.outputs[0].token_ids) for o in outs
            ]
        assert max((a - b).abs().max().item() for a, b in zip(ours, moved)) > 10 * TOLERANCE
        versions.append(llm.update_weights(model.named_parameters()))
        assert versions[-1] == len(versions)
    return versions


def test_a_policy_gradient_loop_through_a_spawned_core_scores_with_the_trainers_weights(smollm2):
    model = trainer(smollm2)
    with LLM(smollm2, max_num_seqs=8, num_kv_blocks=128) as llm:
        assert policy_gradient_loop(llm, model, num_steps=2) == [1, 2]


def test_the_loop_through_a_daemon_updates_the_daemon_for_every_client(smollm2, tmp_path):
    model = trainer(smollm2)
    address = f"ipc://{tmp_path}/core"
    with running_daemon(smollm2, address, "--max-num-seqs", "8"):
        with LLM(smollm2, core_address=address) as llm, LLM(smollm2, core_address=address) as other:
            assert policy_gradient_loop(llm, model, num_steps=2) == [1, 2]
            out = other.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))[0]
            assert out.weight_version == 2  # the other client sees the new weights too
