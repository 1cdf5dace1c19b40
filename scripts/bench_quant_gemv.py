"""The quantized products (coreserve/worker/cpu/csrc/gemv_quant.c) of one weight matrix, every kept GGUF type against
the fp32 product (gemv.c) of the same shape, by row count, turn about in one run: ms a product (median)
and GB/s of the weight's bytes. The blocks are random bytes with small fp16 scales (speed does not
depend on the values).

    python scripts/bench_quant_gemv.py --shape 8192,2048 --rows 1,4,8,16
    python scripts/bench_quant_gemv.py --shape 151936,1536 --rows 1,16 --types Q6_K  # one type, no fp32
    python scripts/bench_quant_gemv.py --shape 8960,1536 --types Q4_K,Q6_K --int8  # beside integer mode's
    python scripts/bench_quant_gemv.py --build avx2 --int8  # the kernels built as for an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_common import machine, median, print_table, write_json  # noqa: E402

from coreserve.worker.cpu.build import NARROWER_BUILDS  # noqa: E402
from coreserve.worker.cpu.kernels import load_cpu_kernels  # noqa: E402
from coreserve.worker.cpu.linear import gemv  # noqa: E402
from coreserve.worker.cpu.quant_linear import quant_gemv  # noqa: E402
from coreserve.worker.models.quantized import QUANT_TYPES  # noqa: E402

SCALE_FIELDS = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}  # fp16 d (and m/dmin)


def random_blocks(ggml_type: int, num_out: int, num_in: int) -> torch.Tensor:
    rng = np.random.default_rng(ggml_type)
    _, block_bytes, block_weights = QUANT_TYPES[ggml_type]
    blocks = rng.integers(0, 256, (num_out, num_in // block_weights, block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[ggml_type]:
        scales = (rng.standard_normal(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(num_out, -1, 2)
    return torch.from_numpy(blocks.reshape(num_out, -1))


def timed(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        begun = time.perf_counter()
        function()
        times.append(time.perf_counter() - begun)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8192,2048", help="out,in features")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--types", default="all", help="comma-separated names (Q6_K,fp32) or all")
    parser.add_argument("--int8", action="store_true", help="each type in integer mode too (gemv_int8.c)")
    parser.add_argument("--build", choices=("native", *NARROWER_BUILDS), default="native",
                        help="the kernels built for this CPU, or without AVX-512 (avx2), or without any vectors")
    parser.add_argument("--json", default="bench_out/quant_gemv.json")
    args = parser.parse_args()
    num_out, num_in = (int(n) for n in args.shape.split(","))
    kernels = load_cpu_kernels(extra_flags=NARROWER_BUILDS.get(args.build, ()))
    chosen = set(args.types.split(","))
    every = "all" in chosen
    weights = {
        QUANT_TYPES[t][0]: (t, random_blocks(t, num_out, num_in))
        for t in sorted(QUANT_TYPES)
        if every or QUANT_TYPES[t][0] in chosen
    }
    fp32 = torch.randn(num_out, num_in) if every or "fp32" in chosen else None
    rows_out = []
    for num_rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(num_rows, num_in)
        row = {"rows": num_rows}
        for name, (ggml_type, raw) in weights.items():
            seconds = timed(lambda r=raw, t=ggml_type, x=x: quant_gemv(kernels, x, r, t, None), args.repeats)
            row[name] = f"{seconds * 1e3:.2f} ms {raw.numel() / seconds / 1e9:.1f} GB/s"
            if args.int8:
                seconds = timed(lambda r=raw, t=ggml_type, x=x: quant_gemv(kernels, x, r, t, None, True), args.repeats)
                row[f"{name} int8"] = f"{seconds * 1e3:.2f} ms {raw.numel() / seconds / 1e9:.1f} GB/s"
        if fp32 is not None:
            seconds = timed(lambda x=x: gemv(kernels, x, fp32, None), args.repeats)
            row["fp32"] = f"{seconds * 1e3:.2f} ms {fp32.numel() * 4 / seconds / 1e9:.1f} GB/s"
        rows_out.append(row)
    names = [column for name in weights for column in ([name, f"{name} int8"] if args.int8 else [name])]
    print_table(rows_out, ["rows", *names, *(["fp32"] if fp32 is not None else [])])
    write_json(args.json, {"args": vars(args), "machine": machine(), "threads": torch.get_num_threads(),
                           "rows": rows_out})


if __name__ == "__main__":
    main()
