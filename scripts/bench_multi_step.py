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

from coreserve import LLM, SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--core-only",
        action="store_true",
        help="time EngineCore.step alone (no frontend, no sockets): N=1 and N=8 cores turn about",
    )
    parser.add_argument("--json", default="bench_out/multi_step.json")
    return parser.parse_args()


def core_only(args: argparse.Namespace) -> None:
    """Per-token step time of an N=1 core and an N=steps core on the same requests, in this process:
    what a window can save is at most what a single step spends outside the model."""
    from coreserve.engine_core.core import EngineCore
    from coreserve.frontend.engine.engine_args import load_tokenizer, make_config
    from coreserve.protocol.messages import EngineCoreRequest

    configs = {
        n: make_config(args.model, {"max_num_seqs": args.num_requests, "num_scheduler_steps": n})
        for n in (1, args.steps)
    }
    prompts = prompts_of_lengths(load_tokenizer(configs[1].model), [args.input_len] * args.num_requests)
    for k in (None, 5):
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=k)
        cores = {}
        for n, config in configs.items():
            cores[n] = EngineCore(config)
            for i, prompt in enumerate(prompts):
                cores[n].add_request(b"", EngineCoreRequest(str(i), prompt, params, 0.0))
            cores[n].step()  # prefill
        per_token: dict[int, list[float]] = {n: [] for n in cores}
        for _ in range(min(10, args.output_len // args.steps - 1)):
            for n, core in cores.items():
                seconds, _ = timed(lambda core=core, n=n: [core.step() for _ in range(args.steps // n)])
                per_token[n].append(seconds / args.steps)
        one, many = median(per_token[1]), median(per_token[args.steps])
        print(
            f"core only, logprobs={k}: ms per step N=1 {one * 1e3:.2f}, N={args.steps} {many * 1e3:.2f}, "
            f"N={args.steps}/N=1 throughput {one / many:.3f}"
        )


def main() -> None:
    args = parse_args()
    if args.core_only:
        core_only(args)
        return
    engines = {
        n: LLM(args.model, num_scheduler_steps=n, max_num_seqs=args.num_requests) for n in (1, args.steps)
    }
    prompts = prompts_of_lengths(engines[1].get_tokenizer(), [args.input_len] * args.num_requests)
    configs = [(n, k) for n in engines for k in (None, 5)]
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    for llm in engines.values():
        llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    for round_index in range(args.rounds):
        for n, k in configs if round_index % 2 == 0 else configs[::-1]:  # ABBA: drift hits all alike
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=k)
            seconds, _ = timed(lambda n=n, p=params: engines[n].generate(prompts, p, use_tqdm=False))
            times[(n, k)].append(seconds)
            print(f"  steps={n} logprobs={k}: {seconds:.2f} s", flush=True)
    for llm in engines.values():
        llm.shutdown()
    total = args.num_requests * args.output_len

    def paired(a: tuple, b: tuple) -> float:
        """Median over rounds of time(b) / time(a): the throughput of a over b, pair by pair."""
        return median([tb / ta for ta, tb in zip(times[a], times[b])])

    rows = [
        {
            "num_scheduler_steps": n,
            "logprobs": k,
            "tokens_per_s": total / median(times[(n, k)]),
            "vs_steps_1": paired((n, k), (1, k)),
            "vs_no_logprobs": paired((n, k), (n, None)),
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
