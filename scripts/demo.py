"""Generates from a few prompts and answers one chat turn on the real built-in model (builtin:smollm2,
SmolLM2-135M-Instruct from its GGUF file), printing the text and the top logprobs of the first tokens."""

from __future__ import annotations

import argparse

from coreserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "The three primary colours are", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NUM_SHOWN = 3  # first tokens whose candidates are printed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="builtin:smollm2", help="a model folder, a .gguf file or builtin:NAME")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=3)
    with LLM(args.model) as llm:
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            show(output.prompt, output.outputs[0])
        turn = llm.chat(CHAT, params, use_tqdm=False)[0]
        show(f"[chat] {CHAT[0]['content']}", turn.outputs[0])


def show(prompt: str, completion) -> None:
    print(f"\nprompt:     {prompt!r}")
    print(f"completion: {completion.text!r}  ({completion.finish_reason}, "
          f"cumulative logprob {completion.cumulative_logprob:.3f})")
    for position, candidates in enumerate(completion.logprobs[:NUM_SHOWN]):
        listed = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for lp in candidates.values())
        print(f"  token {position}: {listed}")


if __name__ == "__main__":
    main()
