"""The suite's multiple-choice set (tests/data/smollm2_mc.jsonl) through lm-eval, against a coreserve
server, the way lm-eval users score a model with `local-completions`.

    (lm-eval[api]==0.4.13 is in the test extras)
    python scripts/eval_lm_eval.py        # builtin:smollm2; --model PATH for another

It starts `python -m coreserve serve MODEL` on a free loopback port, writes the set as a local lm-eval
task (a YAML file, `--include_path`), saves the engine's tokenizer as a folder for lm-eval to tokenize
with, runs lm-eval's `local-completions` model on the task (echo, logprobs: its log-likelihood
requests), and prints lm-eval's accuracy next to the one computed here from the per-item
log-likelihoods lm-eval logged. tests/test_real_model.py checks the same log-likelihoods against
Hugging Face transformers through the server (docs/models.md states the accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "smollm2_mc.jsonl"
TASK = """task: coreserve_smollm2_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--json", default=None, help="write lm-eval's figures here")
    args = parser.parse_args()
    import lm_eval  # noqa: F401  (fail before starting anything when it is not installed)

    with tempfile.TemporaryDirectory(prefix="coreserve-lm-eval-") as work:
        work_dir = Path(work)
        (work_dir / "tasks").mkdir()
        (work_dir / "tasks" / "coreserve_smollm2_mc.yaml").write_text(TASK.format(data=DATA))
        tokenizer_dir = save_tokenizer(args.model, work_dir / "tokenizer")
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "coreserve", "serve", args.model, "--port", str(port), "--log-level", "warning",
             "--served-model-name", "coreserve"],
            cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server)
            result = run_lm_eval(port, tokenizer_dir, work_dir)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def save_tokenizer(model: str, folder: Path) -> str:
    """The tokenizer the engine uses, saved as a Hugging Face folder lm-eval can load."""
    from coreserve.frontend.llm import LLM

    llm = LLM(model)
    try:
        llm.get_tokenizer().save_pretrained(folder)
    finally:
        llm.shutdown()
    return str(folder)


def run_lm_eval(port: int, tokenizer_dir: str, work_dir: Path) -> dict:
    out_dir = work_dir / "out"
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions",
        "--model_args", f"model=coreserve,base_url=http://127.0.0.1:{port}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={tokenizer_dir},num_concurrent=1,max_retries=1",
        "--tasks", "coreserve_smollm2_mc", "--include_path", str(work_dir / "tasks"),
        "--output_path", str(out_dir), "--log_samples",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=work_dir, env=env)
    elapsed = time.perf_counter() - started
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out_dir.rglob("samples_*.jsonl")).read_text().splitlines()]
    per_item = [[float(r[0]) for r in sample["filtered_resps"]] for sample in samples]
    correct = [
        max(range(len(s)), key=s.__getitem__) == int(sample["target"]) for s, sample in zip(per_item, samples)
    ]
    return {
        "lm_eval acc": results["results"]["coreserve_smollm2_mc"]["acc,none"],
        "acc from the logged log-likelihoods": sum(correct) / len(correct),
        "items": len(samples),
        "seconds": round(elapsed, 1),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.3)


if __name__ == "__main__":
    main()
