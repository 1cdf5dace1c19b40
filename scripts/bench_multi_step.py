"""Multi-step scheduling on a decode-heavy workload: throughput with num_scheduler_steps=N over N=1,
without logprobs and with logprobs=5, alternated in one run.

    python scripts/bench_multi_step.py --model builtin:tiny --num-requests 64 --output-len 256 --steps 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, print_table, prompts_of_lengths, timed, write_json  # noqa: E402

from frontend import LLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="bench_out/multi_step.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    engines = {
        n: LLM(args.model, num_scheduler_steps=n, max_num_seqs=args.num_requests) for n in (1, args.steps)
    }
    prompts = prompts_of_lengths(engines[1].get_tokenizer(), [args.input_len] * args.num_requests)
    configs = [(n, k) for n in engines for k in (None, 5)]
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    for llm in engines.values():
        llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    for _ in range(args.rounds):
        for n, k in configs:
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=k)
            seconds, _ = timed(lambda n=n, p=params: engines[n].generate(prompts, p, use_tqdm=False))
            times[(n, k)].append(seconds)
            print(f"  steps={n} logprobs={k}: {seconds:.2f} s", flush=True)
    for llm in engines.values():
        llm.shutdown()
    total = args.num_requests * args.output_len
    rate = {c: total / median(times[c]) for c in configs}
    rows = [
        {
            "num_scheduler_steps": n,
            "logprobs": k,
            "tokens_per_s": rate[(n, k)],
            "vs_steps_1": rate[(n, k)] / rate[(1, k)],
            "vs_no_logprobs": rate[(n, k)] / rate[(n, None)],
        }
        for n, k in configs
    ]
    print_table(rows, ["num_scheduler_steps", "logprobs", "tokens_per_s", "vs_steps_1", "vs_no_logprobs"])
    write_json(
        args.json,
        {
            "args": vars(args),
            "machine": machine(),
            "rows": rows,
            "times": {f"{n}/{k}": t for (n, k), t in times.items()},
        },
    )


if __name__ == "__main__":
    main()
