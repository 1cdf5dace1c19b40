"""What batch invariance costs: output throughput with `batch_invariant=True` against `False`, per
weight dtype, at one request at a time and at many at once, alternated in one run (ABBA), each
ratio paired by round. The workloads are bench_dtype.py's (greedy, EOS ignored; concurrency 1 sends
prompts one after another, concurrency N sends N ShareGPT-shaped prompts in one call).

    python scripts/bench_batch_invariance.py --model builtin:small --dtypes float32,bfloat16 --concurrency 1,32
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, print_table, timed, write_json  # noqa: E402
from bench_dtype import run, workload  # noqa: E402

from coreserve import LLM  # noqa: E402

MODES = {"off": False, "invariant": True}  # the first is each ratio's baseline


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--single-prompts", type=int, default=3, help="prompts sent one by one at 1")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request at 1")
    parser.add_argument("--max-output-len", type=int, default=128, help="cap of the ShareGPT lengths")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="bench_out/batch_invariance.json")
    return parser.parse_args()


def measure(llms: dict[str, LLM], prompts: list, output_lens: list[int], concurrency: int, rounds: int):
    """Tokens/s of each mode and each round's throughput ratio invariant / off (paired)."""
    for llm in llms.values():
        run(llm, prompts[:2], [8, 8], concurrency)  # warm-up
    times: dict[str, list[float]] = {mode: [] for mode in llms}
    count = 0
    for round_index in range(rounds):
        for mode in list(llms) if round_index % 2 == 0 else list(llms)[::-1]:
            seconds, count = timed(lambda m=mode: run(llms[m], prompts, output_lens, concurrency))
            times[mode].append(seconds)
            print(f"  concurrency {concurrency}, {mode}: {count} tokens in {seconds:.2f} s", flush=True)
    ratios = [off / inv for off, inv in zip(times["off"], times["invariant"])]
    return {
        "concurrency": concurrency,
        "output_tokens": count,
        "off_tokens_per_s": count / median(times["off"]),
        "invariant_tokens_per_s": count / median(times["invariant"]),
        "invariant_over_off": median(ratios),
        "rounds": [round(r, 3) for r in ratios],
    }


def main() -> None:
    args = parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        llms = {mode: LLM(args.model, dtype=dtype, batch_invariant=on) for mode, on in MODES.items()}
        tokenizer = llms["off"].get_tokenizer()
        for concurrency in map(int, args.concurrency.split(",")):
            prompts, output_lens = workload(tokenizer, concurrency, args)
            load = os.getloadavg()[0]
            row = {"dtype": dtype, **measure(llms, prompts, output_lens, concurrency, args.rounds)}
            rows.append({**row, "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)})
        for llm in llms.values():
            llm.shutdown()
    print_table(rows, list(rows[0]))
    write_json(args.json, {"args": vars(args), "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
