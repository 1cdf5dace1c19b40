"""bf16 logprobs of the engine against Hugging Face: its bf16 run, and fp32 on the same bf16 weights.

Greedy generation with logprobs=5; HF scores the engine's own tokens (teacher forcing), so every listed
logprob has a reference. Prints the largest |difference| over all of them and over the first
generated token, and how many greedy sequences equal HF bf16's argmax path, for the engine with its
CPU kernels and on torch's bf16 path. docs/decisions.md (CPU kernels) quotes this.

    python scripts/compare_bf16_logprobs.py --model builtin:small
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from coreserve import LLM, SamplingParams
from coreserve.frontend.engine.engine_args import make_config

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "It was the best of times, it was the worst of times, it was the age of wisdom",
    "Q: What is 2 + 2?\nA:",
    "<html><body>",
    "import numpy as np\nimport torch\n\n",
    "The mitochondria is the powerhouse",
]


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].double(), dim=-1)


def compare(llm: LLM, references: dict, max_tokens: int) -> dict:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
    worst = {name: 0.0 for name in references} | {f"{name}_first": 0.0 for name in references}
    num_same = 0
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        prompt_ids, tokens = tokenizer(prompt).input_ids, list(output.outputs[0].token_ids)
        start = len(prompt_ids) - 1
        for name, model in references.items():
            reference = hf_logprobs(model, prompt_ids + tokens)
            if name == "hf_bf16":
                num_same += reference[start:-1].argmax(-1).tolist() == tokens
            for position, entry in enumerate(output.outputs[0].logprobs, start=start):
                for token_id, logprob in entry.items():
                    gap = abs(logprob.logprob - reference[position, token_id].item())
                    worst[name] = max(worst[name], gap)
                    if position == start:
                        worst[f"{name}_first"] = max(worst[f"{name}_first"], gap)
    return worst | {"greedy_equal_to_hf_bf16": f"{num_same}/{len(PROMPTS)}"}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    path = make_config(args.model, {}).model
    references = {
        "hf_bf16": AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(),
        "hf_fp32_on_bf16_weights": AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        .float()
        .eval(),
    }
    for can_use_cpu_kernels in (True, False):
        with LLM(
            args.model, multiprocess=False, dtype="bfloat16", can_use_cpu_kernels=can_use_cpu_kernels
        ) as llm:
            worst = compare(llm, references, args.max_tokens)
        path_name = "C kernels" if can_use_cpu_kernels else "torch bf16"
        print(
            path_name,
            "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in worst.items()),
        )


if __name__ == "__main__":
    main()
