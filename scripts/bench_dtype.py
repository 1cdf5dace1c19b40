"""Output throughput of the same model with bf16 weights against fp32, at one request at a time and
at many at once, alternated in one run (ABBA), each ratio paired by round. Greedy, EOS ignored.

Concurrency 1 sends the prompts one after another (what one interactive user feels); concurrency N
sends N prompts in one `generate` call (ShareGPT-shaped lengths, as bench_throughput.py).

    python scripts/bench_dtype.py --model builtin:small --concurrency 1,32 --rounds 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    machine,
    median,
    print_table,
    prompts_of_lengths,
    sharegpt_like_lengths,
    timed,
    write_json,
)

from coreserve import LLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="the first is the baseline")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--single-prompts", type=int, default=3, help="prompts sent one by one at 1")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request at 1")
    parser.add_argument("--max-output-len", type=int, default=128, help="cap of the ShareGPT lengths")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="bench_out/dtype.json")
    return parser.parse_args()


def workload(tokenizer, concurrency: int, args) -> tuple[list, list[int]]:
    if concurrency == 1:
        return prompts_of_lengths(tokenizer, [128] * args.single_prompts), [
            args.output_len
        ] * args.single_prompts
    input_lens, output_lens = sharegpt_like_lengths(concurrency, max_output=args.max_output_len)
    return prompts_of_lengths(tokenizer, input_lens), output_lens


def run(llm: LLM, prompts: list, output_lens: list[int], concurrency: int) -> int:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    batches = [
        (prompts[i : i + concurrency], params[i : i + concurrency])
        for i in range(0, len(prompts), concurrency)
    ]
    outputs = [
        o for batch, batch_params in batches for o in llm.generate(batch, batch_params, use_tqdm=False)
    ]
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def measure(llms: dict[str, LLM], prompts: list, output_lens: list[int], concurrency: int, rounds: int):
    """Rows of tokens/s per dtype, and each round's time ratio to the first dtype's (paired)."""
    dtypes = list(llms)
    for llm in llms.values():
        run(llm, prompts[:2], [8, 8], concurrency)  # warm-up
    times: dict[str, list[float]] = {d: [] for d in dtypes}
    for round_index in range(rounds):
        for dtype in dtypes if round_index % 2 == 0 else dtypes[::-1]:
            seconds, count = timed(lambda d=dtype: run(llms[d], prompts, output_lens, concurrency))
            times[dtype].append(seconds)
            print(f"  concurrency {concurrency}, {dtype}: {count} tokens in {seconds:.2f} s", flush=True)
    return [
        {
            "concurrency": concurrency,
            "dtype": dtype,
            "output_tokens": count,
            "tokens_per_s": count / median(times[dtype]),
            "ratio_vs_" + dtypes[0]: median([b / t for b, t in zip(times[dtypes[0]], times[dtype])]),
        }
        for dtype in dtypes
    ]


def main() -> None:
    args = parse_args()
    llms = {dtype: LLM(args.model, dtype=dtype) for dtype in args.dtypes.split(",")}
    tokenizer = next(iter(llms.values())).get_tokenizer()
    rows = []
    for concurrency in map(int, args.concurrency.split(",")):
        prompts, output_lens = workload(tokenizer, concurrency, args)
        rows += measure(llms, prompts, output_lens, concurrency, args.rounds)
    for llm in llms.values():
        llm.shutdown()
    print_table(rows, list(rows[0]))
    write_json(args.json, {"args": vars(args), "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
