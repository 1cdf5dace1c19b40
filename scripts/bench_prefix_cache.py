"""Prefix caching on against off, in one run: a shared system prompt (throughput and TTFT P50), the same
shape scored (`prompt_logprobs=5`, one token: what lm-eval's multiple choice sends; the prompt rows the
cached blocks keep), n completions of one prompt (prefill tokens, from the engine's counter), and
prompts that share nothing (what the hashing costs). Prints a table of ratios; writes JSON.

    python scripts/bench_prefix_cache.py --model builtin:small
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, print_table, prompts_of_lengths, write_json  # noqa: E402

from coreserve import AsyncLLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--distinct-len", type=int, default=256, help="prompt length of the no-overlap workload"
    )
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--n-prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="bench_out/prefix_cache.json")
    return parser.parse_args()


async def run_batch(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """All prompts at once; returns output tokens/s and the TTFT of each request."""
    start = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> tuple[float, int]:
        first, count = None, 0
        async for out in engine.generate(prompt, params, f"b{i}-{start}"):
            count += sum(len(c.token_ids) for c in out.outputs)
            if first is None and count:
                first = time.perf_counter() - start
        return first, count

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    return {"tok_s": sum(c for _, c in results) / elapsed, "ttft_p50": median([t for t, _ in results])}


def workloads(engine: AsyncLLM, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    tokenizer = engine.get_tokenizer()
    system = prompts_of_lengths(tokenizer, [args.system_len], seed=1)[0]
    users = prompts_of_lengths(tokenizer, [args.user_len] * args.num_requests, seed=2)
    return {
        "shared": [system + u for u in users],
        "scored": [prompts_of_lengths(tokenizer, [args.system_len], seed=6)[0] + u for u in users],
        "distinct": prompts_of_lengths(tokenizer, [args.distinct_len] * args.num_requests, seed=3),
        "n": prompts_of_lengths(tokenizer, [args.n_prompt_len], seed=4),
    }


async def measure(caching: bool, args: argparse.Namespace) -> dict:
    max_len = args.system_len + args.user_len + args.output_len + 16
    with AsyncLLM(
        args.model, enable_prefix_caching=caching, max_model_len=max_len, max_num_seqs=args.num_requests
    ) as engine:
        loads = workloads(engine, args)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        warmup = prompts_of_lengths(engine.get_tokenizer(), [16] * 4, seed=5)  # first steps pay one-off costs
        await run_batch(engine, warmup, SamplingParams(max_tokens=4))
        row = {"caching": caching}  # each engine starts with an empty cache (the warm-up shares nothing)
        shared = await run_batch(engine, loads["shared"], params)
        row.update(shared_tok_s=shared["tok_s"], shared_ttft_p50=shared["ttft_p50"])
        before = (await engine.get_engine_stats()).num_prefill_tokens
        scored = await run_batch(engine, loads["scored"], SamplingParams(max_tokens=1, prompt_logprobs=5))
        row["scored_req_s"] = scored["tok_s"]  # one token each
        row["scored_prefill_tokens"] = (await engine.get_engine_stats()).num_prefill_tokens - before
        row["distinct_tok_s"] = (await run_batch(engine, loads["distinct"], params))["tok_s"]
        before = (await engine.get_engine_stats()).num_prefill_tokens
        await run_batch(engine, loads["n"], SamplingParams(n=args.n, max_tokens=4, seed=0))
        row["n_prefill_tokens"] = (await engine.get_engine_stats()).num_prefill_tokens - before
        return row


def main() -> None:
    args = parse_args()
    rows = []
    for round_index in range(args.rounds):
        for caching in (True, False) if round_index % 2 == 0 else (False, True):  # ABBA
            rows.append(asyncio.run(measure(caching, args)))
            print_table(rows[-1:], list(rows[-1]))
    on = [r for r in rows if r["caching"]]
    off = [r for r in rows if not r["caching"]]

    def ratio(key: str) -> float:
        return median([r[key] for r in on]) / median([r[key] for r in off])

    ratios = {
        "shared_throughput_on_off": ratio("shared_tok_s"),
        "shared_ttft_p50_on_off": ratio("shared_ttft_p50"),
        "n_prefill_tokens_off_on": 1 / ratio("n_prefill_tokens"),
        "scored_throughput_on_off": ratio("scored_req_s"),
        "scored_prefill_tokens_off_on": 1 / ratio("scored_prefill_tokens"),
        "distinct_throughput_on_off": ratio("distinct_tok_s"),
    }
    print_table([ratios], list(ratios))
    write_json(args.json, {"args": vars(args), "machine": machine(), "rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
