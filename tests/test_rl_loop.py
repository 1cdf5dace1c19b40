"""The RL loop end to end: a trainer holds the HF model and takes policy-gradient steps on a toy reward;
the engine generates with logprobs and gets the new weights through `update_weights` after each step.
After each update every generated token's logprob equals the HF model's forward with the trainer's
current weights (fp32), the weight version advances, and every output of a step carries that step's
version: no request sees mixed weights. On the real SmolLM2-135M through a spawned core; through a
daemon seen by two clients on the built-in tiny model (its HF twin), where only the daemon is new.

Kept cheap: two prompts of eight tokens, the trainer's forwards batched (one right-padded forward per
check) on one torch thread, only the last layer and the final norm trained, the core on one thread."""

from __future__ import annotations

import pytest
import torch
from conftest import IS_BF16_MODE, load_hf, running_daemon
from hf_reference import gguf_reference_folder, one_torch_thread

from coreserve import LLM
from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(IS_BF16_MODE, reason="the 1e-4 claim is fp32's (the trainer's weights)")

PROMPTS = ["The capital of France is", "Once upon a time"]
TOLERANCE = 1e-4
MOVED = 1e-3  # a step must move some logprob by more than this, or the old weights would pass the check
ROLLOUT = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=11)


def trainer(folder: str):
    """The HF model, only its last layer and final norm trained (every weight still goes to the engine
    in the first update; the later ones send the trained part, a partial update)."""
    model = load_hf(folder)
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith((last, "model.norm.")))
    return model


def completion_logprobs(model, outs) -> list[torch.Tensor]:
    """log p(completion token i | its prefix) under `model` for each output, in one right-padded forward
    (real positions never attend a pad), lm_head only on the completion rows; with the gradient."""
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    ids = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(sequences):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [batch, width, hidden]
    result = []
    for row, out in enumerate(outs):
        start, completion = len(out.prompt_token_ids) - 1, out.outputs[0].token_ids
        logits = model.lm_head(hidden[row, start : start + len(completion)]).float()
        result.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(completion).unsqueeze(1))[:, 0])
    return result


def engine_logprobs(outs) -> list[torch.Tensor]:
    return [torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def worst_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y.detach()).abs().max().item() for x, y in zip(a, b))


def reward(text: str) -> float:
    """Toy: the share of vowels in the completion."""
    return sum(c in "aeiou" for c in text) / max(1, len(text))


def rollout(llm: LLM, version: int) -> list:
    outs = llm.generate(PROMPTS, ROLLOUT)
    assert {o.weight_version for o in outs} == {version}  # one version for the whole step
    assert_scoring_equals_generation(llm, outs)
    return outs


def assert_scoring_equals_generation(llm: LLM, outs) -> None:
    """The engine's own scoring of each rollout (prompt logprobs of prompt + completion) gives the very
    logprobs the completion was sampled with, bit for bit (batch invariance: issue 23)."""
    sequences = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids} for o in outs]
    scored = llm.generate(sequences, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    for out, score in zip(outs, scored):
        start, completion = len(out.prompt_token_ids), out.outputs[0]
        for step, token in enumerate(completion.token_ids):
            assert score.prompt_logprobs[start + step][token].logprob == completion.logprobs[step][token].logprob


def policy_gradient_loop(llm: LLM, model, num_updates: int) -> list[int]:
    """Rollout, check against the trainer, one optimizer step, update; then the last update's check."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.Adam([p for _, p in trained], lr=1e-4)
    versions = [0]
    outs = rollout(llm, 0)
    with one_torch_thread():
        for step in range(num_updates):
            ours, theirs = engine_logprobs(outs), completion_logprobs(model, outs)
            worst = worst_difference(ours, theirs)
            assert worst <= TOLERANCE, f"step {step}: engine vs the trainer's weights differ by {worst:.2e}"
            rewards = [reward(o.outputs[0].text) for o in outs]
            optimizer.zero_grad()
            (-sum(r * lp.sum() for r, lp in zip(rewards, theirs))).backward()
            optimizer.step()
            with torch.no_grad():
                assert worst_difference(ours, completion_logprobs(model, outs)) > MOVED
            versions.append(llm.update_weights(model.named_parameters() if step == 0 else trained))
            outs = rollout(llm, versions[-1])
        with torch.no_grad():
            worst = worst_difference(engine_logprobs(outs), completion_logprobs(model, outs))
    assert worst <= TOLERANCE, f"after the last update: engine vs the trainer's weights differ by {worst:.2e}"
    return versions


def test_a_policy_gradient_loop_through_a_spawned_core_scores_with_the_trainers_weights():
    smollm2 = builtin_model_path("smollm2")
    model = trainer(gguf_reference_folder(smollm2))  # the weights the engine dequantized, as HF holds them
    # float32: dtype auto would keep the GGUF's Q8_0 blocks, which take no new weights
    with LLM(smollm2, dtype="float32", max_num_seqs=4, num_kv_blocks=32, num_threads=1) as llm:
        assert policy_gradient_loop(llm, model, num_updates=2) == [0, 1, 2]


def test_the_loop_through_a_daemon_updates_the_daemon_for_every_client(tiny_path, tmp_path):
    model = trainer(tiny_path)
    address = f"ipc://{tmp_path}/core"
    with running_daemon(tiny_path, address, "--max-num-seqs", "4", "--num-threads", "1"):
        with LLM(tiny_path, core_address=address) as llm, LLM(tiny_path, core_address=address) as other:
            assert policy_gradient_loop(llm, model, num_updates=2) == [0, 1, 2]
            out = other.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))[0]
            assert out.weight_version == 2  # the other client sees the new weights too
