"""Differential fuzzer of the model code (tests/gguf_fuzz*.py): for each seed, a random small model of a
family, written as a GGUF in a loader type or a llama-quantize-like mix, must give the same bits kept in
its blocks as dequantized to fp32, alone and batched, and its fp32 run must agree with transformers on
the safetensors twin to 1e-4. One line per failing case, with what reruns it; then a table per family
and per type. The exit code is 1 when any case failed. The hybrid families (Qwen3.5, Qwen3-Next, LFM2,
Granite 4.0-H) and issue 65's (OLMo 2, OLMo 3, SmolLM3, Exaone 4, gpt-oss): llama.cpp's converter writes their
files, 5-30 s a case; they are skipped, with the reason, where scripts/setup.sh --test has not extracted it.

    python scripts/fuzz_models.py --seeds 1000                       # the nightly run (every pair 5 times)
    python scripts/fuzz_models.py --seeds 200 --families gemma2,gemma3 --types Q4_K,Q4_K_M
    python scripts/fuzz_models.py --first-seed 17 --seeds 1 --families qwen3 --types F16 -v   # one case
    python scripts/fuzz_models.py --seeds 40 --families qwen3_5,qwen3_next,lfm2,granitemoehybrid
    python scripts/fuzz_models.py --seeds 30 --families gpt_oss --types MXFP4,llama-quantize:MXFP4_MOE,Q8_0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from gguf_fuzz import ALL_FAMILIES, LLAMA_QUANTIZE, MIXES, MORE_TYPES, TYPES, draw_case  # noqa: E402
from gguf_fuzz_check import CaseResult, check_case  # noqa: E402
from gguf_fuzz_files import DEFAULT_LLAMA_QUANTIZE  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100, help="cases to run (default 100)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first case's seed (default 0)")
    parser.add_argument("--families", default=",".join(ALL_FAMILIES), help="comma-separated (default: all)")
    parser.add_argument("--types", help="comma-separated GGUF types or mixes (default: all of "
                        f"{', '.join(TYPES + MORE_TYPES + MIXES)}, and {LLAMA_QUANTIZE[0].split(':')[0]}:Q4_K_M and the like "
                        "where the binary is there)")
    parser.add_argument("--llama-quantize", default=str(DEFAULT_LLAMA_QUANTIZE),
                        help="llama.cpp's quantizer, for the llama-quantize:* types (default: where "
                        "scripts/build_llama_server.sh builds it)")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line for every case, with its shape")
    args = parser.parse_args()
    has_quantizer = Path(args.llama_quantize).is_file()
    if not has_quantizer:
        args.llama_quantize = None
    known_types = TYPES + MORE_TYPES + MIXES + LLAMA_QUANTIZE
    default_types = known_types if has_quantizer else TYPES + MORE_TYPES + MIXES
    args.families, args.types = args.families.split(","), (args.types or ",".join(default_types)).split(",")
    if not has_quantizer and set(args.types) & set(LLAMA_QUANTIZE):
        parser.error(f"the llama-quantize:* types need llama-quantize; not found at {DEFAULT_LLAMA_QUANTIZE}")
    for name, given, known in (("family", args.families, ALL_FAMILIES), ("type", args.types, known_types)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown {name} {unknown}; known: {', '.join(known)}")
    return args


def run_seed(seed: int, index: int, families: list[str], types: list[str], llama_quantize: str | None) -> CaseResult:
    """The seed's case, of the index-th (family, type) of the lists' product (family fastest: as many
    seeds as pairs cover every family in every type), run in a scratch folder."""
    family, weight_type = families[index % len(families)], types[(index // len(families)) % len(types)]
    case = draw_case(seed, family, weight_type)
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        try:
            return check_case(case, Path(folder), llama_quantize)
        except Exception as exc:  # a crash is a failure of the case like any other
            return CaseResult(case, [f"error: {type(exc).__name__}: {exc}".splitlines()[0]])


def print_table(results: list[CaseResult]) -> None:
    for title, key in (("family", lambda r: r.case.family), ("type", lambda r: r.case.weight_type)):
        runs, failed = Counter(key(r) for r in results), Counter(key(r) for r in results if r.failures)
        skipped = Counter(key(r) for r in results if r.skipped)
        print(f"\n{title:<24} {'cases':>6} {'failed':>6} {'skipped':>7}")
        for name in sorted(runs):
            print(f"{name:<24} {runs[name]:>6} {failed[name]:>6} {skipped[name]:>7}")


def main() -> int:
    args = parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    results, start = [], time.monotonic()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        result = run_seed(seed, seed - args.first_seed, args.families, args.types, args.llama_quantize)
        results.append(result)
        case = result.case
        if result.skipped:
            print(f"SKIP seed={seed} {case.family} {case.weight_type}: {result.skipped}", flush=True)
        elif args.verbose:
            status = "FAIL" if result.failures else "ok"
            print(f"{status} {case.name} {result.seconds:.1f}s hf {result.hf_worst:.2g}: {case.describe()}")
        for failure in result.failures[:1] if not args.verbose else result.failures:
            print(f"FAIL seed={seed} {case.family} {case.weight_type}: {failure} | rerun: python "
                  f"scripts/fuzz_models.py --first-seed {seed} --seeds 1 --families {case.family} "
                  f"--types {case.weight_type} -v", flush=True)
    print_table(results)
    num_failed, num_skipped = sum(bool(r.failures) for r in results), sum(bool(r.skipped) for r in results)
    print(f"\n{len(results)} cases, {num_failed} failed, {num_skipped} skipped, {time.monotonic() - start:.0f} s")
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
