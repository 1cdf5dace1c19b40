"""coreserve against llama.cpp's server on a mixture of experts (issue 41): a random-weight Qwen3-MoE
in Qwen3-30B-A3B's layer shape with 6 of its 48 layers, in the files people download, side by side in
one run on this host.

    scripts/build_llama_server.sh                     # once: llama-server and llama-quantize
    python scripts/bench_moe.py                       # Q4_K_M and Q8_0
    python scripts/bench_moe.py --types Q8_0 --json bench_out/moe.json
    python scripts/bench_moe.py --types Q4_K_M --int8  # integer mode as a third server

The model (scripts/write_random_gguf.py --arch qwen3moe --layers 6): hidden 2048, 32 query heads and 4
KV heads of 128, 128 experts of FFN 768 with 8 a token (renormalised), q/k norms, SmolLM2's 49,152-token
vocabulary, tied embeddings: 3.8B parameters, 0.35B active a token (the lm_head's 0.1B among them; the
real model's 48 layers make the lm_head a smaller share). llama.cpp's `llama-quantize` makes each
preset from the F16 file. The figures are scripts/bench_gguf_1b.py's: c1 and c16 output tokens/s, 4
prompts of 512 tokens (prompt tokens/s; coreserve's scoring rate beside), RSS after load and at peak
against the file, each server's median over `--repeats` batches, the order flipped from file to file.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, write_json  # noqa: E402
from bench_gguf_1b import LLAMA_QUANTIZE, SLOTS, make_files, side_by_side  # noqa: E402
from bench_llama_cpp import LLAMA_SERVER  # noqa: E402

LAYERS = 6
KV_BYTES_PER_TOKEN = LAYERS * 2 * 4 * 128 * 4  # layers x (K, V) x KV heads x head dim x fp32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"])
    parser.add_argument("--folder", default="bench_out")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--c1-tokens", type=int, default=64)
    parser.add_argument("--c16-tokens", type=int, default=32)
    parser.add_argument("--int8", action="store_true", help="coreserve in integer mode as well")
    parser.add_argument("--json", default="bench_out/moe.json")
    args = parser.parse_args()
    args.distance = False
    for tool in (LLAMA_SERVER, LLAMA_QUANTIZE):
        if not tool.exists():
            raise SystemExit(f"{tool} is missing: build it with scripts/build_llama_server.sh")
    files = make_files(Path(args.folder), args.types, "random-moe", ("--arch", "qwen3moe", "--layers", str(LAYERS)))
    results: dict = {"machine": machine(), "threads": 2, "slots": SLOTS, "layers": LAYERS, "files": {}}
    rng = random.Random(0)
    for index, (type_name, path) in enumerate(files.items()):
        figures = side_by_side(path, index, args, rng, KV_BYTES_PER_TOKEN)
        results["files"][type_name] = figures
        print(type_name, figures, flush=True)
        write_json(args.json, results)


if __name__ == "__main__":
    main()
