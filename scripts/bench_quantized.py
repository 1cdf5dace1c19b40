"""A GGUF model kept quantized in memory (dtype auto) against the same file dequantized to bf16 and to
fp32 at load: output tokens/s at concurrency 1 and 32 (greedy, EOS ignored, engines alternated ABBA),
the bytes a batch-1 decode step reads and the bandwidth that implies, and the engine core's resident
memory against the file's size plus its KV cache (issue 25; docs/quantized.md).

Each engine is a spawned core (its own process, so its RSS is its own), one at a time. Bytes per step:
every linear weight once (lm_head included; a tied table counted as lm_head's read), the embedding row,
and the KV cache attended to (both layers' K and V of every position, fp32). Baseline RSS: a process that
imports what the core imports, with no model. Memory is VmRSS and RssAnon (the process's own pages:
VmRSS less the shared library code that running torch's operators pages in, ~8 MiB), each less the
baseline's, right after load and after the runs. The KV cache is sized to the workload (`--kv-blocks`,
default: the largest concurrency's sequences at full length), since the pool's free blocks are handed
out least recently used first: over the rounds every block of the pool is written, so the cache's
resident bytes are the pool's, not the positions live at once.

    python scripts/bench_quantized.py --model builtin:smollm2 --concurrency 1,32 --rounds 2
    python scripts/bench_quantized.py --max-tokens 4 --rounds 1 --single-prompts 1   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, print_table, prompts_of_lengths, timed, write_json  # noqa: E402

from coreserve import LLM, SamplingParams  # noqa: E402
from coreserve.protocol.builtin_model import builtin_model_path  # noqa: E402

_CORE_IMPORTS = "import torch, transformers, coreserve.engine_core.__main__, coreserve.worker.model_runner"
_BLOCK_SIZE = 16  # tokens per KV-cache block, set on the engine with the pool's size


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
    parser.add_argument("--kv-blocks", type=int, default=0, help="KV-cache blocks; 0: the workload's at most")
    parser.add_argument("--bandwidth-gbs", type=float, default=0.0, help="the machine's measured GB/s, for the fraction")
    parser.add_argument("--json", default="bench_out/quantized.json")
    return parser.parse_args()


def model_path(name: str) -> str:
    return builtin_model_path(name.removeprefix("builtin:")) if name.startswith("builtin:") else name


def kv_bytes_per_position(path: str) -> int:
    """fp32 K and V of every layer for one position."""
    from coreserve.worker.models.config import DecoderArgs
    from coreserve.worker.models.loader import read_config

    a = DecoderArgs.from_hf_config(read_config(path))
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4


def step_bytes(path: str, dtype: str, context: int) -> int:
    """Bytes a batch-1 decode step reads at `context` positions: the weights of every product, one
    embedding row, the KV cache."""
    import torch
    from torch import nn

    from coreserve.worker.models.loader import load_model

    model = load_model(path, dtype, torch.device("cpu"))
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    total = sum(w.numel() * w.element_size() for w in weights.values())
    table = model.embed_tokens.weight
    return total + table[0].numel() * table.element_size() + context * kv_bytes_per_position(path)


def _resident(status: str) -> dict[str, float]:
    """VmRSS and RssAnon (MiB) of a /proc/PID/status text."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon")}


def rss_mib(pid: int) -> dict[str, float]:
    return _resident(Path(f"/proc/{pid}/status").read_text())


def baseline_rss() -> dict[str, float]:
    """The resident MiB of a process that imports what the core imports."""
    code = f"{_CORE_IMPORTS}; import os; print(open('/proc/self/status').read())"
    return _resident(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def core_pid() -> int:
    import psutil

    children = [c for c in psutil.Process().children(recursive=True) if "coreserve.engine_core" in " ".join(c.cmdline())]
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
    """One engine: per concurrency, each round's seconds; its core's RSS right after load and after the runs."""
    engine_args = {"dtype": dtype, "max_num_seqs": max(workloads), "block_size": _BLOCK_SIZE,
                   "num_kv_blocks": kv_blocks(args, max(workloads))}
    if args.num_threads:
        engine_args["num_threads"] = args.num_threads
    rows = []
    with LLM(path, **engine_args) as llm:
        loaded = rss_mib(core_pid())  # the model alone: no KV written, no activations yet
        generate(llm, workloads[max(workloads)][:2], 4, 2)  # warm-up
        for concurrency, prompts in workloads.items():
            seconds = []
            for _ in range(args.rounds):
                elapsed, count = timed(lambda c=concurrency, p=prompts: generate(llm, p, args.max_tokens, c))
                seconds.append(elapsed)
                print(f"  {dtype} concurrency {concurrency}: {count} tokens in {elapsed:.2f} s", flush=True)
            rows.append({"dtype": dtype, "concurrency": concurrency, "tokens": count,
                         "tok_s": count / median(seconds), "seconds": seconds})
        time.sleep(1.0)  # the core hands its heap's free pages back when it goes idle (release_heap)
        after = rss_mib(core_pid())
    for row in rows:
        row["loaded"], row["after"] = loaded, after
    return rows


def kv_blocks(args, concurrency: int) -> int:
    """The KV-cache blocks of `concurrency` sequences of the workload at full length (a block to spare each)."""
    return args.kv_blocks or concurrency * (-(-(args.prompt_len + args.max_tokens) // _BLOCK_SIZE) + 1)


def main() -> None:
    args = parse_args()
    path = model_path(args.model)
    from coreserve.frontend.engine.engine_args import load_tokenizer

    tokenizer = load_tokenizer(path)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workloads = {c: prompts_of_lengths(tokenizer, [args.prompt_len] * (args.single_prompts if c == 1 else c), seed=c)
                 for c in concurrencies}
    rows = []
    for dtype in args.dtypes.split(","):
        rows += measure(path, dtype, workloads, args)
    context = args.prompt_len + args.max_tokens // 2  # the mean position of a decode step
    base = baseline_rss()
    file_mib = os.path.getsize(path) / 2**20
    kv_mib = kv_blocks(args, max(concurrencies)) * _BLOCK_SIZE * kv_bytes_per_position(path) / 2**20
    per_step = {dtype: step_bytes(path, dtype, context) for dtype in args.dtypes.split(",")}
    for row in rows:
        num_bytes = per_step[row["dtype"]]
        row["mb_per_token"] = num_bytes / 1e6
        if row["concurrency"] == 1:
            row["gb_s"] = num_bytes * row["tok_s"] / 1e9
            row["of_bandwidth"] = row["gb_s"] / args.bandwidth_gbs if args.bandwidth_gbs else None
        for name, key in (("rss", "VmRSS"), ("anon", "RssAnon")):
            row[f"loaded_{name}_mib"] = row["loaded"][key] - base[key]
            row[f"after_{name}_mib"] = row["after"][key] - base[key]
    print_table(rows, ["dtype", "concurrency", "tok_s", "mb_per_token", "gb_s", "of_bandwidth", "loaded_rss_mib",
                       "loaded_anon_mib", "after_rss_mib", "after_anon_mib"])
    print(f"file {file_mib:.1f} MiB; KV cache {kv_mib:.1f} MiB; a process with the core's imports and no model: "
          f"VmRSS {base['VmRSS']:.1f}, RssAnon {base['RssAnon']:.1f} MiB")
    row = next((r for r in rows if r["dtype"] == "auto"), None)  # the file's blocks: issue 25's ratios
    if row is not None:
        print(f"{row['dtype']}: loaded / file {row['loaded_rss_mib'] / file_mib:.3f} (RssAnon "
              f"{row['loaded_anon_mib'] / file_mib:.3f}); after / (file + KV cache) "
              f"{row['after_rss_mib'] / (file_mib + kv_mib):.3f} (RssAnon {row['after_anon_mib'] / (file_mib + kv_mib):.3f})")
    write_json(args.json, {"machine": machine(), "model": path, "file_mib": file_mib, "baseline_rss_mib": base,
                           "kv_mib": kv_mib, "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
