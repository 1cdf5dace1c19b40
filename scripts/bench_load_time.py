"""Load time: `LLM(model)` plus one greedy token, in fresh processes, with where the time goes.

    python scripts/bench_load_time.py                       # builtin:smollm2 (the GGUF file), 5 runs
    python scripts/bench_load_time.py --hf-folder           # the same model saved as a HF folder
    python scripts/bench_load_time.py --model builtin:tiny --runs 3 --json load_time.json

Each run is a new Python process that imports coreserve, builds `LLM(model)` (which spawns its core)
and generates one token. The phases come from the `startup:` lines that the frontend and the core log
at INFO (the run turns them on for the `frontend`, `engine_core` and `worker` loggers); the two
processes run side by side, so the phases of one overlap the other's and do not add up to the total.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# What one run does, in its own process; it prints its own timings as one JSON line.
CHILD = """
import json, logging, sys, time
started, clock = time.time(), time.perf_counter()
logging.basicConfig(level=logging.WARNING, format="%(message)s")
for name in ("coreserve",):
    logging.getLogger(name).setLevel(logging.INFO)
from coreserve.frontend.llm import LLM
from coreserve.protocol.sampling_params import SamplingParams
imported = time.perf_counter()
llm = LLM(sys.argv[1])
built = time.perf_counter()
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
done = time.perf_counter()
print(json.dumps({"started": started, "frontend imports": imported - clock, "LLM()": built - imported,
                  "first token": done - built, "to first token": done - clock,
                  "torch in frontend": "torch" in sys.modules, "text": out[0].outputs[0].text}))
llm.shutdown()
"""

# (column, regex on the stderr of a run); times in seconds except the unix timestamps
PHASES = [
    ("tokenizer", r"startup: tokenizer loaded after ([\d.]+) s"),
    ("core ready", r"startup: core ready after ([\d.]+) s"),
    ("spawn at", r"startup: spawning the engine core at ([\d.]+) \(unix\)"),
    ("core at", r"startup: process at ([\d.]+) \(unix\)"),
    ("core args", r"arguments ([\d.]+) s"),
    ("core imports", r"imports ([\d.]+) s, engine"),
    ("core engine", r"engine ([\d.]+) s, sockets"),
    ("core sockets", r"sockets ([\d.]+) s"),
    ("model load", r"model load ([\d.]+) s"),
    ("kernels", r"kernels ([\d.]+) s"),
    ("backend", r"backend ([\d.]+) s"),
    ("KV cache", r"startup: KV cache ([\d.]+) s"),
]


def run_once(model: str) -> dict:
    launched = time.time()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, pattern in PHASES:
        found = re.search(pattern, proc.stderr)
        row[name] = float(found.group(1)) if found else None
    row["wall"] = time.time() - launched  # interpreter start to exit, shutdown included
    row["python start"] = row.pop("started") - launched
    if row["spawn at"] is not None and row["core at"] is not None:
        row["core process start"] = row["core at"] - row["spawn at"]
    return row


def hf_folder(gguf_path: str) -> str:
    """The GGUF model saved once as a Hugging Face folder from transformers' GGUF loader (fp32
    safetensors, its config without quantization_config, the converted tokenizer), under
    ~/.cache/coreserve. transformers will not save_pretrained a model it loaded from GGUF, so the
    config and tensors are written here."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path.home() / ".cache" / "coreserve" / f"{Path(gguf_path).stem}-hf-v2"
    if (folder / "model.safetensors").exists():
        return str(folder)
    source, name = str(Path(gguf_path).parent), Path(gguf_path).name
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    tmp = folder.with_name(folder.name + f".{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]  # empty from GGUF
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(source, gguf_file=name).save_pretrained(str(tmp))
    os.rename(tmp, folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--hf-folder", action="store_true", help="the model (a GGUF file) as a HF folder")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="write the runs and medians here")
    args = parser.parse_args()
    model = args.model
    if args.hf_folder:
        from coreserve.protocol.builtin_model import builtin_model_path

        model = hf_folder(
            builtin_model_path(model.split(":", 1)[1]) if model.startswith("builtin:") else model
        )
    rows = [run_once(model) for _ in range(args.runs)]
    columns = ["wall", "to first token", "python start", "frontend imports", "LLM()", "first token",
               "tokenizer", "core ready", "core process start", "core imports", "core engine", "model load",
               "kernels", "backend", "KV cache", "core sockets"]
    medians = {
        c: median([r[c] for r in rows if r.get(c) is not None]) for c in columns if rows[0].get(c) is not None
    }
    print(f"{model}: {args.runs} fresh processes; medians in seconds "
          f"(torch imported in the frontend: {rows[0]['torch in frontend']}; text {rows[0]['text']!r})")
    print_table([{"phase": c, "median s": round(v, 3)} for c, v in medians.items()], ["phase", "median s"])
    if args.json:
        write_json(args.json, {"model": model, "runs": rows, "medians": medians})


if __name__ == "__main__":
    main()
