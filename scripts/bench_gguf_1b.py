"""coreserve against llama.cpp's server at the size people deploy: a random-weight 1.07B Llama-shaped
model in the files people download (issue 38), side by side in one run on this host.

    scripts/build_llama_server.sh                     # once: llama-server and llama-quantize
    python scripts/bench_gguf_1b.py                   # Q4_0, Q8_0, Q4_K_M
    python scripts/bench_gguf_1b.py --types Q4_K_M --json bench_out/gguf_1b.json
    python scripts/bench_gguf_1b.py --file ~/.cache/coreserve/real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

`--file` measures any GGUF file instead of the random ones (a trained file from
scripts/real_models.py, say); its KV cache's size is read from its header. `--int8` measures coreserve
in integer mode too (`--quantized-activations int8`, docs/quantized.md), a third server in the turn.

The files: scripts/write_random_gguf.py writes the F16 model (hidden 2048, 16 layers, 32 heads, 8 KV
heads, FFN 8192, SmolLM2's tokenizer and chat template, tied embeddings), and llama.cpp's own
`llama-quantize` makes each preset from it, as every GGUF on the hub is made (made once, kept in
bench_out/). For each file the two servers take turns (the order flips from file to file), each up only
while it is measured, with 2 threads each (as many as cores) and 16 slots:

- c1 and c16: output tokens/s of 1 and of 16 requests sent at once (greedy, `ignore_eos`);
- prompt: 4 requests of 512 random token ids at once, 1 token out each: prompt tokens/s;
- scoring (coreserve): the same with `echo` and `logprobs: 1` and `max_tokens: 0`, so every position's
  logprob is computed (llama-server has no prompt logprobs: the figure stands against its prompt rate);
- RSS: the engine process's resident memory after load (before any request) and at its peak, against
  the file (coreserve: the engine-core process; its KV cache is reserved for --num-kv-blocks and
  counted where it is touched, reported beside).

Every measured batch takes fresh prompts, so neither server's prefix cache serves a repeat. The figure
is each server's median over `--repeats` batches. `--distance` also scores llama.cpp's greedy tokens
with the fp32 model (scripts/bench_llama_cpp.py's logprob distance; the file's blocks kept, which give the
fp32 model's bits without its memory).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, write_json  # noqa: E402
from bench_llama_cpp import LLAMA_SERVER, distance, start, throughput  # noqa: E402

from coreserve.protocol.gguf_header import read_gguf_header  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA_QUANTIZE = LLAMA_SERVER.parent / "llama-quantize"
SLOTS = 16
PROMPT_TOKENS, PROMPTS_AT_ONCE = 512, 4
KV_BLOCKS = SLOTS * 1024 // 16  # coreserve: 1024 tokens a slot, as llama-server's -c 16384 over 16 slots
KV_BYTES_PER_TOKEN = 16 * 2 * 8 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0", "Q4_K_M"])
    parser.add_argument("--file", nargs="+", default=None, help="GGUF files to measure instead of the random ones")
    parser.add_argument("--folder", default="bench_out", help="where the 1B files are made and kept")
    parser.add_argument("--repeats", type=int, default=2, help="measured batches per figure")
    parser.add_argument("--c1-tokens", type=int, default=64)
    parser.add_argument("--c16-tokens", type=int, default=32)
    parser.add_argument("--distance", action="store_true", help="llama.cpp's logprob distance from fp32")
    parser.add_argument("--int8", action="store_true", help="coreserve in integer mode as well")
    parser.add_argument("--json", default="bench_out/gguf_1b.json")
    args = parser.parse_args()
    for tool in (LLAMA_SERVER,) if args.file else (LLAMA_SERVER, LLAMA_QUANTIZE):
        if not tool.exists():
            raise SystemExit(f"{tool} is missing: build it with scripts/build_llama_server.sh")
    files = {Path(f).stem: Path(f).expanduser() for f in args.file} if args.file else make_files(Path(args.folder), args.types)
    results: dict = {"machine": machine(), "threads": 2, "slots": SLOTS, "files": {}}
    rng = random.Random(0)
    for index, (type_name, path) in enumerate(files.items()):
        kv_bytes = kv_bytes_per_token(path) if args.file else KV_BYTES_PER_TOKEN
        figures = side_by_side(path, index, args, rng, kv_bytes)
        if args.distance:
            # the blocks kept give the fp32 model's bits (gpt-oss-20b's shape in fp32: 17 GB at 4 layers)
            figures["logprob distance"] = distance(str(path), str(LLAMA_SERVER), 32, dtype="auto")
        results["files"][type_name] = figures
        print(type_name, figures, flush=True)
        write_json(args.json, results)  # what is measured so far, kept if a later file fails


def side_by_side(path: Path, index: int, args: argparse.Namespace, rng: random.Random, kv_bytes: int) -> dict:
    """One file's figures for coreserve (and in integer mode with `args.int8`) and llama-server, the order
    flipped from file to file, with each coreserve's ratios to llama-server."""
    ours = ["coreserve", "coreserve int8"] if args.int8 else ["coreserve"]
    order = [*ours, "llama.cpp"] if index % 2 == 0 else ["llama.cpp", *ours[::-1]]
    figures = {name: measure(name, str(path), args, rng, kv_bytes) for name in order}
    for name in ours:
        ratios = {key: figures[name][key] / figures["llama.cpp"][key] for key in ("c1 tok/s", "c16 tok/s", "prompt tok/s")}
        ratios["scoring / llama.cpp prompt"] = figures[name]["scoring tok/s"] / figures["llama.cpp"]["prompt tok/s"]
        figures[f"{name} / llama.cpp"] = ratios
    figures["file MiB"] = path.stat().st_size / 2**20
    return figures


def kv_bytes_per_token(path: Path) -> int:
    """coreserve's fp32 KV cache a token, from the file's header: layers x (K, V) x KV heads x head dim x 4."""
    meta = read_gguf_header(str(path)).metadata
    arch = meta["general.architecture"]
    heads, kv_heads = int(meta[f"{arch}.attention.head_count"]), meta.get(f"{arch}.attention.head_count_kv")
    head_dim = meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // heads
    return int(meta[f"{arch}.block_count"]) * 2 * int(kv_heads or heads) * int(head_dim) * 4


def make_files(
    folder: Path, types: list[str], stem: str = "random-1b", writer_args: tuple[str, ...] = ()
) -> dict[str, Path]:
    """The F16 model (written once by write_random_gguf.py with `writer_args`) and each preset made from
    it by llama-quantize (once), named `stem`-TYPE.gguf."""
    folder.mkdir(parents=True, exist_ok=True)
    f16 = folder / f"{stem}-f16.gguf"
    if not f16.exists():
        script = str(ROOT / "scripts" / "write_random_gguf.py")
        subprocess.run([sys.executable, script, *writer_args, "--out", str(f16)], check=True)
    files = {}
    for type_name in types:
        files[type_name] = folder / f"{stem}-{type_name}.gguf"
        if not files[type_name].exists():
            subprocess.run([str(LLAMA_QUANTIZE), str(f16), str(files[type_name]), type_name, "2"], check=True,
                           stdout=subprocess.DEVNULL)
    return files


def measure(
    name: str, path: str, args: argparse.Namespace, rng: random.Random, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
) -> dict:
    is_ours = name.startswith("coreserve")
    extra = ["--num-kv-blocks", str(KV_BLOCKS)] if is_ours else []
    extra += ["--quantized-activations", "int8"] if name == "coreserve int8" else []
    with start("coreserve" if is_ours else name, path, str(LLAMA_SERVER), SLOTS, extra=extra) as server:
        base = server.base
        engine_pid = server.engine_pid()
        held = rss_mib(engine_pid)
        asyncio.run(throughput(base, 1, 8))  # warm-up, not counted
        figures = {
            "c1 tok/s": median([asyncio.run(throughput(base, 1, args.c1_tokens)) for _ in range(args.repeats)]),
            "c16 tok/s": median(
                [asyncio.run(throughput(base, SLOTS, args.c16_tokens)) for _ in range(args.repeats)]
            ),
            "prompt tok/s": median([asyncio.run(prompt_rate(base, rng, False)) for _ in range(args.repeats)]),
        }
        if is_ours:
            figures["scoring tok/s"] = median(
                [asyncio.run(prompt_rate(base, rng, True)) for _ in range(args.repeats)]
            )
        figures["RSS after load MiB"] = held
        figures["RSS peak MiB"] = rss_mib(engine_pid, "VmHWM")
        if is_ours:
            figures["KV cache reserved MiB"] = KV_BLOCKS * 16 * kv_bytes_per_token / 2**20
    return figures


async def prompt_rate(base: str, rng: random.Random, score: bool) -> float:
    """Prompt tokens/s of PROMPTS_AT_ONCE fresh prompts of PROMPT_TOKENS random ids sent at once; `score`:
    every position's logprob too (echo, nothing generated)."""
    prompts = [[rng.randrange(1000, 48000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS_AT_ONCE)]
    extra = {"echo": True, "logprobs": 1, "max_tokens": 0} if score else {"max_tokens": 1}
    body = {"model": "m", "temperature": 0.0, **extra}
    async with httpx.AsyncClient(timeout=None) as http:
        started = time.perf_counter()
        responses = await asyncio.gather(
            *(http.post(base + "/v1/completions", json={**body, "prompt": p}) for p in prompts)
        )
        elapsed = time.perf_counter() - started
    for response in responses:
        response.raise_for_status()
        if score:
            assert len(response.json()["choices"][0]["logprobs"]["token_logprobs"]) == PROMPT_TOKENS
    return PROMPT_TOKENS * PROMPTS_AT_ONCE / elapsed


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


if __name__ == "__main__":
    main()
