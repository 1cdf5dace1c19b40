"""One benchmark, two checkouts, ABBA order in one run: the ratio of a figure the benchmark writes to its
JSON, B over A. For a change that must not move the speed (a refactor), A is the commit before it (a
`git worktree` of it) and B the working tree; each run is a fresh process whose imports come from its
own checkout (PYTHONPATH and the working directory both point there; the spawned core inherits them).

    git worktree add /tmp/before HEAD~5
    python scripts/bench_abba.py --a /tmp/before --b . --key step_ms --rounds 2 -- \\
        scripts/bench_decode_step.py --model builtin:small --batch 1 --context 128 --steps 30

`--key` is a dotted path into the JSON (`rows.0.tokens_per_s`); the benchmark's own `--json` is set
by this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="checkout A (the reference)")
    parser.add_argument("--b", required=True, help="checkout B (the change)")
    parser.add_argument("--key", required=True, help="dotted path of the figure in the benchmark's JSON")
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds (each runs A twice, B twice)")
    parser.add_argument("--json", default="bench_out/abba.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS (a path inside each checkout)")
    args = parser.parse_args()
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command  # the separator only
    return args


def figure(data: dict, key: str) -> float:
    for part in key.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return float(data)


def run_in(checkout: str, command: list[str], key: str) -> float:
    """The figure of one fresh run of `command` (its script taken from `checkout`)."""
    root = str(Path(checkout).resolve())
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "out.json")
        env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
        script, *rest = command
        subprocess.run([sys.executable, str(Path(root) / script), *rest, "--json", out], cwd=root, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        return figure(json.loads(Path(out).read_text()), key)


def main() -> None:
    args = parse_args()
    values: dict[str, list[float]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for side in "ABBA":
            value = run_in(args.a if side == "A" else args.b, args.command, args.key)
            values[side].append(value)
            print(f"  {side}: {args.key} = {value:.4g}", flush=True)
    ratio = median(values["B"]) / median(values["A"])
    print(f"median A {median(values['A']):.4g}, median B {median(values['B']):.4g}: B / A = {ratio:.3f}")
    write_json(args.json, {"args": vars(args), "machine": machine(), "values": values, "b_over_a": ratio})


if __name__ == "__main__":
    main()
