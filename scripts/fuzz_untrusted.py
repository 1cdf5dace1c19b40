"""Fuzzes the engine's untrusted inputs (tests/untrusted_fuzz.py): GGUF files, Hugging Face folders, LoRA
adapters and chat templates, mutated from valid ones and loaded as the engine loads them in a child process;
each must be refused with a ValueError within the time limit and the memory limit, or load (printed, for a
human to judge), and a real engine must still serve afterwards. Prints a table of outcomes and every case
that was not refused; the exit code is 1 when a case crashed, hung or grew past the limit, or the engine
did not serve.

    python scripts/fuzz_untrusted.py                                  # the catalog and 100 random cases
    python scripts/fuzz_untrusted.py --cases 500 --seed 3 --json out.json
    python scripts/fuzz_untrusted.py --groups gguf --first-case 40 --cases 1 -v   # one case again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from untrusted_fuzz import (  # noqa: E402
    GROUPS,
    MEMORY_LIMIT_MIB,
    TIME_LIMIT_S,
    case_line,
    catalog,
    draw_cases,
    outcome_table,
    run_fuzz,
)

NUM_RANDOM = 100  # random cases after the catalog by default


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, help=f"cases to run (default: the catalog and {NUM_RANDOM} random)")
    parser.add_argument("--seed", type=int, default=0, help="the random cases' seed (default 0)")
    parser.add_argument("--first-case", type=int, default=0, help="the first case's index (default 0)")
    parser.add_argument("--groups", default=",".join(GROUPS), help="comma-separated (default: all of them)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds a case (default 10)")
    parser.add_argument("--memory-limit", type=float, default=MEMORY_LIMIT_MIB, help="MiB of growth (default 512)")
    parser.add_argument("--json", type=Path, help="write every case's result here")
    parser.add_argument("--log", type=Path, help="the child process's own output (default: discarded)")
    parser.add_argument("--cache-dir", type=Path, help="where the valid bases are made once and found again "
                        "(default: ~/.cache/coreserve/untrusted-fuzz-v1)")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line for every case, refused ones too")
    args = parser.parse_args()
    args.groups = tuple(args.groups.split(","))
    unknown = sorted(set(args.groups) - set(GROUPS))
    if unknown:
        parser.error(f"unknown group {unknown}; known: {', '.join(GROUPS)}")
    if args.cases is None:
        args.cases = len(catalog(args.groups)) + NUM_RANDOM
    return args


def main() -> int:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def show(result) -> None:
        if args.verbose or result.outcome != "refused":
            print(case_line(result), flush=True)

    report = run_fuzz(lambda bases: draw_cases(bases, args.seed, args.cases, args.first_case, args.groups),
                      args.time_limit, args.memory_limit, show, cache_dir=args.cache_dir, log_path=args.log)
    print("\n" + outcome_table(report.results))
    print(f"\nserving afterwards: {json.dumps(report.serving)}")
    print(f"{len(report.results)} cases in {report.seconds:.0f} s (the child's start {report.prepare_seconds:.0f} s, "
          f"the serving check {report.serve_seconds:.0f} s), {report.num_starts} child process(es)")
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "seconds": report.seconds, "serving": report.serving,
                                         "cases": [dataclasses.asdict(r) for r in report.results]}, indent=1))
    return 1 if report.has_failed else 0


if __name__ == "__main__":
    sys.exit(main())
