"""A GGUF model kept quantized in memory (dtype auto) against the same file dequantized to bf16 and to
fp32 at load: output tokens/s at concurrency 1 and 32 (greedy, EOS ignored, engines alternated ABBA),
the bytes a batch-1 decode step reads and the bandwidth that implies, and the engine core's resident
memory against the file's size plus the KV cache it wrote (issue 25; docs/quantized.md).

Each engine is a spawned core (its own process, so its RSS is its own), one at a time. Bytes per step:
every linear weight once (lm_head included; a tied table counted as lm_head's read), the embedding row,
and the KV cache attended to (both layers' K and V of every position, fp32). Baseline RSS: a process that
imports what the core imports, with no model.

    python scripts/bench_quantized.py --model builtin:smollm2 --concurrency 1,32 --rounds 2
    python scripts/bench_quantized.py --max-tokens 4 --rounds 1 --single-prompts 1   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, print_table, prompts_of_lengths, timed, write_json  # noqa: E402

from frontend import LLM, SamplingParams  # noqa: E402
from protocol.builtin_model import builtin_model_path  # noqa: E402

_CORE_IMPORTS = "import torch, transformers, engine_core.__main__, worker.model_runner"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2", help="a GGUF file (or builtin:smollm2)")
    parser.add_argument("--dtypes", default="auto,bfloat16,float32", help="auto: the file's quantization kept")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--single-prompts", type=int, default=3, help="prompts sent one by one at 1")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=0, help="the core's threads; 0: its default")
    parser.add_argument("--bandwidth-gbs", type=float, default=0.0, help="the machine's measured GB/s, for the fraction")
    parser.add_argument("--json", default="bench_out/quantized.json")
    return parser.parse_args()


def model_path(name: str) -> str:
    return builtin_model_path(name.removeprefix("builtin:")) if name.startswith("builtin:") else name


def kv_bytes_per_position(path: str) -> int:
    """fp32 K and V of every layer for one position."""
    from worker.models.config import LlamaArgs
    from worker.models.loader import read_config

    a = LlamaArgs.from_hf_config(read_config(path))
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4


def step_bytes(path: str, dtype: str, context: int) -> int:
    """Bytes a batch-1 decode step reads at `context` positions: the weights of every product, one
    embedding row, the KV cache."""
    import torch
    from torch import nn

    from worker.models.loader import load_model

    model = load_model(path, dtype, torch.device("cpu"))
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    total = sum(w.numel() * w.element_size() for w in weights.values())
    table = model.embed_tokens.weight
    return total + table[0].numel() * table.element_size() + context * kv_bytes_per_position(path)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def baseline_rss() -> int:
    """The resident bytes of a process that imports what the core imports."""
    code = f"{_CORE_IMPORTS}; import os; print(open('/proc/self/status').read())"
    status = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def core_pid() -> int:
    import psutil

    children = [c for c in psutil.Process().children(recursive=True) if "engine_core" in " ".join(c.cmdline())]
    assert len(children) == 1, children
    return children[0].pid


def generate(llm: LLM, prompts: list, max_tokens: int, concurrency: int) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    count = 0
    for start in range(0, len(prompts), concurrency):
        outputs = llm.generate(prompts[start : start + concurrency], params, use_tqdm=False)
        count += sum(len(o.outputs[0].token_ids) for o in outputs)
    return count


def measure(path: str, dtype: str, workloads: dict[int, list], args) -> list[dict]:
    """One engine: per concurrency, each round's seconds; its core's RSS after the runs."""
    engine_args = {"dtype": dtype, "max_num_seqs": max(workloads)}
    if args.num_threads:
        engine_args["num_threads"] = args.num_threads
    rows = []
    with LLM(path, **engine_args) as llm:
        loaded_rss = rss_bytes(core_pid())  # the model alone: no KV written, no activations yet
        generate(llm, workloads[max(workloads)][:2], 4, 2)  # warm-up
        for concurrency, prompts in workloads.items():
            seconds = []
            for _ in range(args.rounds):
                elapsed, count = timed(lambda c=concurrency, p=prompts: generate(llm, p, args.max_tokens, c))
                seconds.append(elapsed)
                print(f"  {dtype} concurrency {concurrency}: {count} tokens in {elapsed:.2f} s", flush=True)
            rows.append({"dtype": dtype, "concurrency": concurrency, "tokens": count,
                         "tok_s": count / median(seconds), "seconds": seconds})  # fmt: skip
        rss = rss_bytes(core_pid())
    for row in rows:
        row["core_rss_mib"] = rss / 2**20
        row["loaded_rss_mib"] = loaded_rss / 2**20
    return rows


def main() -> None:
    args = parse_args()
    path = model_path(args.model)
    from frontend.engine_args import load_tokenizer

    tokenizer = load_tokenizer(path)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workloads = {c: prompts_of_lengths(tokenizer, [args.prompt_len] * (args.single_prompts if c == 1 else c), seed=c)
                 for c in concurrencies}  # fmt: skip
    rows = []
    for dtype in args.dtypes.split(","):
        rows += measure(path, dtype, workloads, args)
    context = args.prompt_len + args.max_tokens // 2  # the mean position of a decode step
    base = baseline_rss() / 2**20
    file_mib = os.path.getsize(path) / 2**20
    kv_mib = {c: c * (args.prompt_len + args.max_tokens) * kv_bytes_per_position(path) / 2**20
              for c in concurrencies}  # the positions written, at most at once  # fmt: skip
    per_step = {dtype: step_bytes(path, dtype, context) for dtype in args.dtypes.split(",")}
    for row in rows:
        num_bytes = per_step[row["dtype"]]
        row["mb_per_token"] = num_bytes / 1e6
        if row["concurrency"] == 1:
            row["gb_s"] = num_bytes * row["tok_s"] / 1e9
            row["of_bandwidth"] = row["gb_s"] / args.bandwidth_gbs if args.bandwidth_gbs else None
        row["model_rss_mib"] = row["core_rss_mib"] - base
        row["loaded_model_mib"] = row["loaded_rss_mib"] - base
    print_table(rows, ["dtype", "concurrency", "tok_s", "mb_per_token", "gb_s", "of_bandwidth", "core_rss_mib",
                       "model_rss_mib", "loaded_model_mib"])  # fmt: skip
    kv_text = ", ".join(f"concurrency {c}: {mib:.1f}" for c, mib in kv_mib.items())
    print(f"file {file_mib:.1f} MiB; a process with the core's imports and no model {base:.1f} MiB; "
          f"KV cache written at most ({kv_text}) MiB")  # fmt: skip
    write_json(args.json, {"machine": machine(), "model": path, "file_mib": file_mib, "baseline_rss_mib": base,
                           "kv_mib": kv_mib, "rows": rows, "args": vars(args)})  # fmt: skip


if __name__ == "__main__":
    main()
