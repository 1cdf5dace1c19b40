"""Structured outputs' cost: throughput of a batch where half the requests carry a JSON schema, over the
same batch without any (goal >= 0.9), alternated in one run; and whether the unconstrained half's
greedy tokens are the same in both batches (they must be).

The schema (an array of at least --output-len integers) keeps every constrained request generating to
max_tokens, so both batches generate the same number of tokens. docs/structured_outputs.md.

    python scripts/bench_structured.py --model builtin:smollm2 --num-requests 32 --output-len 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, print_table, prompts_of_lengths, timed, write_json  # noqa: E402

from coreserve import LLM, SamplingParams  # noqa: E402
from coreserve.protocol.structured_outputs import StructuredOutputsParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="bench_out/structured.json")
    return parser.parse_args()


def batch_params(args: argparse.Namespace, is_constrained: bool) -> list[SamplingParams]:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": args.output_len}
    grammar = StructuredOutputsParams(json=schema)
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=args.output_len,
            ignore_eos=True,
            structured_outputs=grammar if is_constrained and i % 2 == 0 else None,
        )
        for i in range(args.num_requests)
    ]


def main() -> None:
    args = parse_args()
    llm = LLM(args.model, max_num_seqs=args.num_requests)
    prompts = prompts_of_lengths(llm.get_tokenizer(), [args.input_len] * args.num_requests)
    batches = {"plain": batch_params(args, False), "half_schema": batch_params(args, True)}
    llm.generate(prompts[:2], batches["half_schema"][:2], use_tqdm=False)  # warm-up, and the compile
    times: dict[str, list[float]] = {name: [] for name in batches}
    tokens: dict[str, int] = {}
    unconstrained: dict[str, list[list[int]]] = {}
    for round_index in range(args.rounds):
        order = list(batches) if round_index % 2 == 0 else list(batches)[::-1]  # ABBA
        for name in order:
            seconds, outputs = timed(lambda p=batches[name]: llm.generate(prompts, p, use_tqdm=False))
            times[name].append(seconds)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outputs)
            unconstrained[name] = [o.outputs[0].token_ids for o in outputs[1::2]]
            print(f"  {name}: {seconds:.2f} s, {tokens[name]} tokens", flush=True)
    llm.shutdown()
    rate = {name: tokens[name] / median(times[name]) for name in batches}
    pairs = [tp / tc * tokens["half_schema"] / tokens["plain"] for tp, tc in zip(times["plain"], times["half_schema"])]
    rows = [
        {"batch": name, "tokens": tokens[name], "tokens_per_s": rate[name], "vs_plain": 1.0}
        for name in batches
    ]
    rows[1]["vs_plain"] = median(pairs)
    print_table(rows, ["batch", "tokens", "tokens_per_s", "vs_plain"])
    is_same = unconstrained["plain"] == unconstrained["half_schema"]
    print(f"unconstrained half's tokens the same in both batches: {is_same}")
    write_json(
        args.json,
        {"args": vars(args), "machine": machine(), "rows": rows, "times": times, "same_unconstrained": is_same},
    )
    if not is_same:
        sys.exit("the unconstrained requests' tokens changed with the grammar rows beside them")


if __name__ == "__main__":
    main()
