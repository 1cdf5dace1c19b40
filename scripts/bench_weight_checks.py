"""What checking a model file costs at load: the whole load (`load_model`, the checks included) against
its finite-weights pass alone (every float tensor scanned, every GGUF block's scales read) and the
header and config checks, on the real files.

    python scripts/bench_weight_checks.py                  # builtin:smollm2 and the real Qwen2.5-Coder 1.5B
    python scripts/bench_weight_checks.py --models builtin:tiny --runs 5 --json checks.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, print_table, write_json  # noqa: E402
from real_models import CACHE  # noqa: E402

from coreserve.protocol.builtin_model import builtin_model_path  # noqa: E402
from coreserve.worker.models.config import DecoderArgs  # noqa: E402
from coreserve.worker.models.finite_weights import check_finite_model  # noqa: E402
from coreserve.worker.models.loader import load_model, read_config  # noqa: E402

DEFAULT_MODELS = ["builtin:smollm2", str(CACHE / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")]


def measure(model: str, runs: int) -> dict:
    path = builtin_model_path(model.split(":", 1)[1]) if model.startswith("builtin:") else model
    loads, checks, configs = [], [], []
    for _ in range(runs):
        begun = time.perf_counter()
        loaded = load_model(path, "auto", torch.device("cpu"))
        loads.append(time.perf_counter() - begun)
        begun = time.perf_counter()
        check_finite_model(loaded, path)
        checks.append(time.perf_counter() - begun)
        begun = time.perf_counter()
        DecoderArgs.from_hf_config(read_config(path))
        configs.append(time.perf_counter() - begun)
        del loaded
    load, check = median(loads), median(checks)
    return {"model": Path(path).name, "load s": load, "finite pass s": check, "share of load": check / load,
            "config checks s": median(configs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [measure(model, args.runs) for model in args.models]
    print_table(rows, list(rows[0]))
    if args.json:
        write_json(args.json, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
