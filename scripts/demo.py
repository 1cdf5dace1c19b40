"""Generates from a few prompts on the built-in tiny model and prints the completions with logprobs."""

from __future__ import annotations

import argparse

from frontend import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is", "def fibonacci(n):"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a Hugging Face model folder (default: built-in tiny)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2)
    with LLM(args.model) as llm:
        for output in llm.generate(PROMPTS, params):
            completion = output.outputs[0]
            print(f"\nprompt:     {output.prompt!r}")
            print(f"completion: {completion.text!r}")
            print(
                f"finish: {completion.finish_reason}, cumulative logprob: {completion.cumulative_logprob:.3f}"
            )
            first = ", ".join(
                f"{lp.decoded_token!r}: {lp.logprob:.3f} (rank {lp.rank})"
                for lp in completion.logprobs[0].values()
            )
            print(f"first token candidates: {first}")
    print("\n(the built-in model has random weights: the text is fluent nonsense by design)")


if __name__ == "__main__":
    main()
