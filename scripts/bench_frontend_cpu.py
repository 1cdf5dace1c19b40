"""Where a logprobs run's frontend CPU goes: per `generate` call, the frontend process's CPU time and
the part of it spent in Python's cyclic garbage collector, without logprobs and with logprobs=k.
On a 2-core machine the frontend's CPU comes out of the core's torch threads, so it shows in the
throughput ratios of bench_multi_step.py.

    python scripts/bench_frontend_cpu.py --model builtin:tiny --num-requests 64 --output-len 256 --steps 8
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import prompts_of_lengths  # noqa: E402

from coreserve import LLM, SamplingParams  # noqa: E402


class GcTimer:
    """Sums the time of the collections that run while it is installed (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._start = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="num_scheduler_steps")
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with LLM(args.model, num_scheduler_steps=args.steps, max_num_seqs=args.num_requests) as llm:
        prompts = prompts_of_lengths(llm.get_tokenizer(), [32] * args.num_requests)
        llm.generate(prompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        print("logprobs  wall_s  frontend_cpu_s  gc_s  collections(gen0, gen1, gen2)")
        for _ in range(args.rounds):
            for k in (None, args.logprobs):
                params = SamplingParams(
                    temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=k
                )
                timer = GcTimer()
                gc.callbacks.append(timer)
                cpu, wall = cpu_seconds(), time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
                gc.callbacks.remove(timer)
                print(f"{k!s:8}  {wall:6.2f}  {cpu:14.3f}  {timer.seconds:.3f}  {timer.collections}")
                del outputs


if __name__ == "__main__":
    main()
