"""TRL's GRPOTrainer with coreserve as its rollout engine (a script; runs on the CPU in about a minute).

`CoreserveRollout` is a `rollout_func` for `GRPOTrainer(rollout_func=...)` (TRL 1.16): it receives the
prompts of this process (each already repeated `num_generations` times by TRL's sampler) and the
trainer, and returns for each prompt its token ids, one sampled completion's token ids, and the
engine's logprob of each completion token (processed: after temperature, as TRL's own loss sees them).
Before generating it sends the trainer's weights to the engine with `LLM.update_weights` whenever the
trainer's global step moved since the last sync, so every rollout of step s comes from the weights
after step s - 1; each output's `weight_version` says which.

    python examples/trl_grpo_rollout.py [--model FOLDER] [--steps 2]

trains the built-in tiny model (its Hugging Face folder) for two GRPO steps on a toy reward (the share
of even token ids in the completion), then prints one JSON line: the steps' losses and gradient norms, the weight versions
the rollouts carried, the engine's final version, and the largest gap between the engine's logprobs
and the trained model's own forward on the final weights (fp32: within 1e-4).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch

from frontend import LLM
from protocol.builtin_model import builtin_model_path
from protocol.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The sky is"]


class CoreserveRollout:
    """A TRL `rollout_func` backed by a coreserve `LLM` (token ids in, token ids and logprobs out)."""

    def __init__(self, llm: LLM, max_tokens: int, temperature: float = 1.0) -> None:
        self.llm = llm
        self.params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, logprobs=0, logprobs_mode="processed_logprobs"
        )
        self.synced_step = 0  # the engine starts on the trainer's initial weights
        self.weight_versions: list[int] = []  # per rollout call: the version its outputs carried
        self.logprobs: list[list[float]] = []  # every completion's logprobs, all calls

    def sync(self, trainer) -> int:
        """Sends the trainer's current parameters (HF names) to the engine; returns the new version."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.synced_step = trainer.state.global_step
        return self.llm.update_weights(model.named_parameters())

    def __call__(self, prompts: list[str], trainer) -> dict[str, list]:
        if trainer.state.global_step != self.synced_step:
            self.sync(trainer)
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        outs = self.llm.generate(prompt_ids, self.params, use_tqdm=False)
        completion_ids = [out.outputs[0].token_ids for out in outs]
        logprobs = [sampled_logprobs(out.outputs[0]) for out in outs]
        self.weight_versions.append(outs[0].weight_version)
        assert all(out.weight_version == outs[0].weight_version for out in outs), "mixed weights in a rollout"
        self.logprobs.extend(logprobs)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def sampled_logprobs(completion) -> list[float]:
    """The logprob of each sampled token (its own entry in each position's dict)."""
    return [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]


def even_token_reward(completion_ids: list[list[int]], **_) -> list[float]:
    """A toy reward that varies within a group: the share of even token ids."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def policy_gap(llm: LLM, model, prompt: str, tokenizer) -> float:
    """Largest |engine logprob - the model's own log-softmax| over one sampled completion."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    params = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=3)
    completion = llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion.token_ids])).logits[0].double()
    start = len(prompt_ids) - 1
    rows = torch.log_softmax(logits[start : start + len(completion.token_ids)], -1)
    reference = rows.gather(1, torch.tensor(completion.token_ids).unsqueeze(1))[:, 0]
    return (torch.tensor(sampled_logprobs(completion), dtype=torch.float64) - reference).abs().max().item()


def train(model_path: str, num_steps: int, output_dir: str) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=output_dir, max_steps=num_steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, temperature=1.0, learning_rate=1e-3, beta=0.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0,
    )
    with LLM(model_path, num_threads=1, max_num_seqs=16, num_kv_blocks=64) as llm:
        rollout = CoreserveRollout(llm, max_tokens=config.max_completion_length)
        trainer = GRPOTrainer(
            model=model_path, reward_funcs=even_token_reward, args=config,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=rollout,
        )
        trainer.train()
        rollout.sync(trainer)  # the weights after the last step
        model = trainer.accelerator.unwrap_model(trainer.model)
        return {
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
            "global_step": trainer.state.global_step,
            "rollout_weight_versions": rollout.weight_versions,
            "weight_version": llm.get_weight_version(),
            "num_logprobs": sum(map(len, rollout.logprobs)),
            "logprobs_finite": all(math.isfinite(x) for row in rollout.logprobs for x in row),
            "policy_gap": policy_gap(llm, model, PROMPTS[0], trainer.processing_class),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an HF Llama folder (default: builtin:tiny's)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="the trainer's torch threads")
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as output_dir:
        result = train(args.model or builtin_model_path("tiny"), args.steps, output_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
