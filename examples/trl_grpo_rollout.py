"""TRL's GRPOTrainer with coreserve as its rollout engine (a script; runs on the CPU in about a minute).

`CoreserveRollout` is a `rollout_func` for `GRPOTrainer(rollout_func=...)` (TRL 1.16): it receives the
prompts of this process (each already repeated `num_generations` times by TRL's sampler) and the
trainer, and returns for each prompt its token ids, one sampled completion's token ids, and the
engine's logprob of each completion token (processed: after temperature, as TRL's own loss sees them).
Before generating it sends the trainer's weights to the engine with `LLM.update_weights` whenever the
trainer's global step moved since the last sync, so every rollout of step s comes from the weights
after step s - 1; each output's `weight_version` says which.

    python examples/trl_grpo_rollout.py [--model FOLDER] [--steps 2] [--peft]

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

from coreserve import LLM, LoRARequest
from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.protocol.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The sky is"]


class CoreserveRollout:
    """A TRL `rollout_func` backed by a coreserve `LLM` (token ids in, token ids and logprobs out)."""

    def __init__(self, llm: LLM, max_tokens: int, temperature: float = 1.0, adapter_dir: str | None = None) -> None:
        self.llm = llm
        self.adapter_dir = adapter_dir  # PEFT training: the adapter alone is synced, through this folder
        self.lora: LoRARequest | None = None  # the synced adapter (None: the base model's weights)
        self.params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, logprobs=0, logprobs_mode="processed_logprobs"
        )
        self.synced_step = 0  # the engine starts on the trainer's initial weights
        self.weight_versions: list[int] = []  # per rollout call: the version its outputs carried
        self.logprobs: list[list[float]] = []  # every completion's logprobs, all calls
        self.adapters: list[str | None] = []  # per rollout call: the adapter it ran with (PEFT)

    def sync(self, trainer) -> int:
        """Sends the trainer's current parameters (HF names) to the engine, or with PEFT its adapter alone
        (saved, then loaded in place between two pauses); returns the engine's new weight version."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        self.synced_step = trainer.state.global_step
        if self.adapter_dir is None:
            return self.llm.update_weights(model.named_parameters())
        model.save_pretrained(self.adapter_dir)
        self.llm.pause_generation("wait")
        int_id = self.llm.load_lora_adapter("policy", self.adapter_dir, load_inplace=self.lora is not None)
        self.llm.resume_generation()
        self.lora = LoRARequest("policy", int_id, self.adapter_dir)
        return self.llm.get_weight_version()

    def __call__(self, prompts: list[str], trainer) -> dict[str, list]:
        if trainer.state.global_step != self.synced_step:
            self.sync(trainer)
        tokenizer = trainer.processing_class
        prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        outs = self.llm.generate(prompt_ids, self.params, use_tqdm=False, lora_request=self.lora)
        completion_ids = [out.outputs[0].token_ids for out in outs]
        logprobs = [sampled_logprobs(out.outputs[0]) for out in outs]
        self.weight_versions.append(outs[0].weight_version)
        self.adapters.append(None if self.lora is None else self.lora.lora_name)
        assert all(out.weight_version == outs[0].weight_version for out in outs), "mixed weights in a rollout"
        self.logprobs.extend(logprobs)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def sampled_logprobs(completion) -> list[float]:
    """The logprob of each sampled token (its own entry in each position's dict)."""
    return [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]


def even_token_reward(completion_ids: list[list[int]], **_) -> list[float]:
    """A toy reward that varies within a group: the share of even token ids."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def policy_gap(llm: LLM, model, prompt: str, tokenizer, lora: LoRARequest | None = None) -> float:
    """Largest |engine logprob - the model's own log-softmax| over one sampled completion (`lora`: the
    engine's request with the synced adapter, the model a PEFT model)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    params = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=3)
    completion = llm.generate([prompt_ids], params, use_tqdm=False, lora_request=lora)[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion.token_ids])).logits[0].double()
    start = len(prompt_ids) - 1
    rows = torch.log_softmax(logits[start : start + len(completion.token_ids)], -1)
    reference = rows.gather(1, torch.tensor(completion.token_ids).unsqueeze(1))[:, 0]
    return (torch.tensor(sampled_logprobs(completion), dtype=torch.float64) - reference).abs().max().item()


def train(model_path: str, num_steps: int, output_dir: str, use_peft: bool = False) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=output_dir, max_steps=num_steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, temperature=1.0, learning_rate=1e-3, beta=0.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0,
    )
    peft_config = None
    if use_peft:  # TRL's GRPO with PEFT: the adapter trains, the base stays; the engine serves both
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"])
    with LLM(model_path, num_threads=1, max_num_seqs=16, num_kv_blocks=64, enable_lora=use_peft) as llm:
        adapter_dir = os.path.join(output_dir, "adapter") if use_peft else None
        rollout = CoreserveRollout(llm, max_tokens=config.max_completion_length, adapter_dir=adapter_dir)
        trainer = GRPOTrainer(
            model=model_path, reward_funcs=even_token_reward, args=config,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), rollout_func=rollout, peft_config=peft_config,
        )
        trainer.train()
        rollout.sync(trainer)  # the weights after the last step
        model = trainer.accelerator.unwrap_model(trainer.model)
        return {
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
            "global_step": trainer.state.global_step,
            "rollout_weight_versions": rollout.weight_versions,
            "rollout_adapters": rollout.adapters,
            "weight_version": llm.get_weight_version(),
            "num_logprobs": sum(map(len, rollout.logprobs)),
            "logprobs_finite": all(math.isfinite(x) for row in rollout.logprobs for x in row),
            "policy_gap": policy_gap(llm, model, PROMPTS[0], trainer.processing_class, rollout.lora),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an HF Llama folder (default: builtin:tiny's)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="the trainer's torch threads")
    parser.add_argument("--peft", action="store_true", help="train a LoRA adapter (PEFT) and sync it alone")
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as output_dir:
        result = train(args.model or builtin_model_path("tiny"), args.steps, output_dir, args.peft)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
