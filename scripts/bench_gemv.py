"""The C few-row products (coreserve/worker/cpu/csrc/gemv.c) against MKL on one decode step's shapes of a built-in
preset, by row count: ms for all the step's linear layers (lm_head included), turn about in one run.

Columns: fp32 weights by the C kernel and by MKL (the transposed way the engine used before, and
plain x @ W^T); bf16 weights by the C kernel (dot instruction, and the widening fallback) and by
torch's bf16 product. GB/s: weight bytes / time.

    python scripts/bench_gemv.py --preset small --rows 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_common import machine, print_table, write_json  # noqa: E402

from coreserve.protocol.builtin_model import GPT2_VOCAB_SIZE, PRESETS  # noqa: E402
from coreserve.worker.cpu.kernels import load_cpu_kernels  # noqa: E402
from coreserve.worker.cpu.linear import gemv, transposed_linear  # noqa: E402


def step_shapes(preset: str) -> list[tuple[int, int]]:
    """(out, in) of each linear layer of one decode step."""
    spec = PRESETS[preset]
    q, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    layer = [(q + 2 * kv, spec.hidden_size), (spec.hidden_size, q),
             (2 * spec.intermediate_size, spec.hidden_size), (spec.hidden_size, spec.intermediate_size)]
    return layer * spec.num_layers + [(GPT2_VOCAB_SIZE, spec.hidden_size)]


def time_all(fn, layers, x_by_in: dict, repeats: int) -> float:
    """Median over `repeats` of the time (s) of one product per layer."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in layers:
            fn(layer, x_by_in[layer.in_features])
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default="bench_out/gemv.json")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C kernels did not build"
    torch.manual_seed(0)
    fp32 = [torch.nn.Linear(k, n, bias=False) for n, k in step_shapes(args.preset)]
    bf16 = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for n, k in step_shapes(args.preset)]
    gb32 = sum(m.weight.numel() for m in fp32) * 4 / 1e9
    configs = {
        "c_fp32": (fp32, lambda m, x: gemv(kernels, x, m.weight, None)),
        "mkl_transposed_fp32": (fp32, transposed_linear),
        "mkl_fp32": (fp32, lambda m, x: m(x)),
        "c_bf16_dot": (bf16, lambda m, x: gemv(kernels, x, m.weight, None, use_bf16_dot=True)),
        "c_bf16_widened": (bf16, lambda m, x: gemv(kernels, x, m.weight, None, use_bf16_dot=False)),
        "torch_bf16": (bf16, lambda m, x: m(x.to(torch.bfloat16))),
    }
    rows_out = []
    with torch.inference_mode():
        for num_rows in map(int, args.rows.split(",")):
            x_by_in = {m.in_features: torch.randn(num_rows, m.in_features) for m in fp32}
            row = {"rows": num_rows}
            for name, (layers, fn) in configs.items():
                time_all(fn, layers, x_by_in, 1)  # warm-up
                row[name] = time_all(fn, layers, x_by_in, args.repeats) * 1e3
            row["c_fp32_GB/s"] = gb32 / row["c_fp32"] * 1e3
            row["c_bf16_dot_GB/s"] = gb32 / 2 / row["c_bf16_dot"] * 1e3
            rows_out.append(row)
            print(f"  rows {num_rows} done", flush=True)
    print(f"ms per decode step's linear layers ({args.preset}: {gb32 * 1e3:.0f} MB fp32, "
          f"bf16 dot instruction: {kernels.has_bf16_dot})")
    print_table(rows_out, list(rows_out[0]))
    write_json(args.json, {"args": vars(args), "machine": machine(), "rows": rows_out})


if __name__ == "__main__":
    main()
