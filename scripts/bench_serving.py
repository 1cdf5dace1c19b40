"""Serving benchmark in the shape of vLLM's: a seeded ShareGPT-like workload sent to AsyncLLM, or over
HTTP to any OpenAI-compatible server (--base-url), at a request rate; prints throughput and
TTFT / TPOT / ITL (mean, median, P99), writes JSON and a PNG.

    python scripts/bench_serving.py --num-requests 100 --logprobs 5
    python scripts/bench_serving.py --compare "" "logprobs=5"      # alternated, ratio of every row
    python scripts/bench_serving.py --compare "inproc" ""          # an in-process core against a spawned one
    coreserve serve builtin:small --port 8000 &                     # then the same workload over HTTP:
    python scripts/bench_serving.py --compare "" "base_url=http://127.0.0.1:8000"   # server / AsyncLLM
    python scripts/bench_serving.py --compare "" "serve"           # the same, the server started here
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --compare "" "logprobs=5"
    python scripts/bench_serving.py --base-url http://127.0.0.1:8080 --send-text   # llama-server (own tokenizer)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from bench_common import machine, prompts_of_lengths, sharegpt_like_lengths, write_json  # noqa: E402
from bench_http_client import HttpDriver, LocalServer  # noqa: E402

from coreserve import AsyncLLM, SamplingParams  # noqa: E402

ENGINE_ARGS = (
    "model",
    "num_scheduler_steps",
    "max_num_seqs",
    "max_num_batched_tokens",
    "dtype",
    "inproc",
    "serve",
    "enable_prefix_caching",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:small")
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="off by default: configurations compared on one engine would read each other's prompts",
    )
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson rate per second; inf: all at once"
    )
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--prompt-logprobs", type=int, default=None)
    p.add_argument("--num-scheduler-steps", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--inproc", action="store_true", help="run the core in this process")
    p.add_argument("--base-url", help="an OpenAI-compatible server to drive over HTTP instead of AsyncLLM")
    p.add_argument("--serve", action="store_true", help="start `coreserve serve` with these engine arguments")
    p.add_argument("--served-model-name", help="with --base-url: the model name to send (default --model)")
    p.add_argument("--api-key", help="with --base-url: sent as Authorization: Bearer KEY")
    p.add_argument("--send-text", action="store_true", help="with --base-url: send prompts as text, not ids")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="with --compare: alternations of A and B")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="two sets of these options, each written name=value without dashes, alternated",
    )
    p.add_argument("--out", default="bench_out/serving")
    return p


class EngineDriver:
    """The in-process path: AsyncLLM.generate, timed delta by delta."""

    def __init__(self, engine: AsyncLLM, args) -> None:
        self.engine, self.args = engine, args
        self.ids = itertools.count()

    async def run(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=self.args.logprobs,
            prompt_logprobs=self.args.prompt_logprobs,
        )
        start, times, num_tokens = time.perf_counter(), [], 0
        async for out in self.engine.generate(prompt, params, f"r{next(self.ids)}-{start}"):
            times.append(time.perf_counter())
            num_tokens += len(out.outputs[0].token_ids)
        return start, times, num_tokens

    async def close(self) -> None:
        pass


async def run_workload(engine: AsyncLLM | None, tokenizer, args, prompts, output_lens) -> dict:
    """One pass of the workload; with --base-url over HTTP (the client made on this event loop)."""
    driver = HttpDriver(args, tokenizer) if args.base_url else EngineDriver(engine, args)
    rng = np.random.default_rng(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    records = [None] * len(prompts)

    async def one(i: int) -> None:
        async with limit:
            start, times, num_tokens = await driver.run(prompts[i], output_lens[i])
        records[i] = {
            "start": start,
            "times": times,
            "output_tokens": num_tokens,
            "input_tokens": len(prompts[i]),
        }

    tasks, began = [], time.perf_counter()
    try:
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(one(i)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        await asyncio.gather(*tasks)
    finally:
        await driver.close()
    return summarize(records, time.perf_counter() - began)


def summarize(records: list[dict], duration: float) -> dict:
    ttft = [(r["times"][0] - r["start"]) * 1e3 for r in records]
    tpot = [
        (r["times"][-1] - r["times"][0]) * 1e3 / (r["output_tokens"] - 1)
        for r in records
        if r["output_tokens"] > 1
    ]
    itl = [(b - a) * 1e3 for r in records for a, b in zip(r["times"], r["times"][1:])]
    out_tokens = sum(r["output_tokens"] for r in records)
    in_tokens = sum(r["input_tokens"] for r in records)
    result = {
        "successful_requests": len(records),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_generated_tokens": out_tokens,
        "request_throughput": len(records) / duration,
        "input_token_throughput": in_tokens / duration,
        "output_token_throughput": out_tokens / duration,
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        result[f"mean_{name}"] = float(np.mean(values))
        result[f"median_{name}"] = float(np.median(values))
        result[f"p99_{name}"] = float(np.percentile(values, 99))
    result["_samples"] = {"ttft_ms": ttft, "tpot_ms": tpot, "itl_ms": itl}
    return result


def print_result(title: str, result: dict, other: dict | None = None) -> None:
    print(f"{'=' * 20} {title} {'=' * 20}")
    for key, value in result.items():
        if key.startswith("_"):
            continue
        line = f"{key:<28}{value:>14.2f}" if isinstance(value, float) else f"{key:<28}{value:>14}"
        if other is not None:
            line += f"{other[key]:>14.2f}" if isinstance(other[key], float) else f"{other[key]:>14}"
            line += f"{other[key] / value:>10.3f}" if value else ""
        print(line)


def plot(path: str, results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for label, result in results.items():
        for ax, name in zip(axes[:3], ("ttft_ms", "tpot_ms", "itl_ms")):
            ax.hist(result["_samples"][name], bins=40, alpha=0.5, label=label)
            ax.set_title(name.replace("_ms", " (ms)").upper())
    axes[3].bar(list(results), [r["output_token_throughput"] for r in results.values()])
    axes[3].set_title("output tokens/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def make_engine(args) -> AsyncLLM | LocalServer:
    if args.serve:
        return LocalServer(args)
    return AsyncLLM(
        args.model,
        multiprocess=not args.inproc,
        num_scheduler_steps=args.num_scheduler_steps,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def load_workload_tokenizer(model: str):
    """The model's tokenizer without an engine (--base-url runs make no AsyncLLM)."""
    from coreserve.frontend.engine.engine_args import load_tokenizer, make_config

    return load_tokenizer(make_config(model, {}).model)


def main() -> None:
    args = parser().parse_args()
    configs = {"run": args}
    if args.compare:
        base = _without_compare(sys.argv[1:])
        configs = {
            label: parser().parse_args(base + _as_options(spec)) for label, spec in zip("AB", args.compare)
        }
    engines: dict[tuple, AsyncLLM | LocalServer | None] = {}
    results: dict[str, list[dict]] = {label: [] for label in configs}
    rounds = args.rounds if args.compare else 1
    tokenizer = None
    try:  # a failed run must not leave a server or a core behind
        for _ in range(rounds):
            for label, config in configs.items():
                key = tuple(getattr(config, name) for name in ENGINE_ARGS) if not config.base_url else None
                if key not in engines:
                    engines[key] = make_engine(config) if key is not None else None
                engine = engines[key]
                if isinstance(engine, LocalServer):  # --serve: driven over HTTP like any other server
                    config.base_url, engine = engine.url, None
                tokenizer = tokenizer or (
                    engine.get_tokenizer() if engine else load_workload_tokenizer(config.model)
                )
                input_lens, output_lens = sharegpt_like_lengths(
                    config.num_requests, config.seed, max_output=config.max_output_len
                )
                prompts = prompts_of_lengths(tokenizer, input_lens, config.seed)
                asyncio.run(run_workload(engine, tokenizer, config, prompts[:4], [4] * 4))  # warm-up
                results[label].append(
                    asyncio.run(run_workload(engine, tokenizer, config, prompts, output_lens))
                )
                print(
                    f"  {label}: {results[label][-1]['output_token_throughput']:.1f} output tokens/s",
                    flush=True,
                )
    finally:
        for engine in engines.values():
            if engine is not None:
                engine.shutdown()
    best = {label: median_result(runs) for label, runs in results.items()}
    if args.compare:
        print_result(f"A: {args.compare[0]!r} | B: {args.compare[1]!r} | B/A", best["A"], best["B"])
    else:
        print_result("Serving Benchmark Result", best["run"])
    plot(args.out + ".png", best)
    clean = {label: {k: v for k, v in r.items() if not k.startswith("_")} for label, r in best.items()}
    write_json(args.out + ".json", {"argv": sys.argv[1:], "machine": machine(), "results": clean})


def _without_compare(argv: list[str]) -> list[str]:
    index = argv.index("--compare")
    return argv[:index] + argv[index + 3 :]


def _as_options(spec: str) -> list[str]:
    """'logprobs=5 inproc' -> ['--logprobs', '5', '--inproc'] (no leading dashes, so argparse cannot
    mistake a configuration for an option of its own)."""
    options = []
    for item in shlex.split(spec):
        name, _, value = item.partition("=")
        options += ["--" + name.replace("_", "-")] + ([value] if value else [])
    return options


def median_result(runs: list[dict]) -> dict:
    """Per row, the median over rounds (samples from the median-throughput round)."""
    if len(runs) == 1:
        return runs[0]
    merged = {
        k: float(np.median([r[k] for r in runs])) if isinstance(runs[0][k], float) else runs[0][k]
        for k in runs[0]
        if not k.startswith("_")
    }
    ordered = sorted(runs, key=lambda r: r["output_token_throughput"])
    merged["_samples"] = ordered[len(ordered) // 2]["_samples"]
    return merged


if __name__ == "__main__":
    main()
