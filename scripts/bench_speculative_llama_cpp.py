"""llama.cpp's server with its own speculation, side by side with bench_speculative.py's cases: the same
SmolLM2 chats, greedy, single stream, its tokens/s with speculation on over off (ABBA: servers off, on,
on, off; timed without logprobs), and whether its logprobs survive speculation (asked for after the
timing: the same values as without it, and the share of exact 0.0).

- ngram: `--spec-type ngram-simple --spec-draft-n-max K` on the Q4_1 file, copy chats and free text;
- draft: the fp32 weights (an F32 GGUF written here from the Q4_1 file's dequantized values, what
  coreserve's dtype="float32" loads) drafted by the Q4_1 file (`-md`, `--spec-draft-n-max K`).

Needs scripts/build_llama_server.sh's llama-server.

    python scripts/bench_speculative_llama_cpp.py [--k 8] [--json bench_out/speculative_llama_cpp.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, print_table, write_json  # noqa: E402
from bench_llama_cpp import start  # noqa: E402
from bench_speculative import COPY_CHATS, FREE_CHATS  # noqa: E402

from coreserve.protocol.builtin_model import builtin_model_path  # noqa: E402

BINARY = Path.home() / ".cache/coreserve/llama.cpp-0.3.36/build/bin/llama-server"


def write_f32_gguf(source: str, target: Path) -> Path:
    """The GGUF's every tensor dequantized to F32, its metadata as it was."""
    if target.exists():
        return target
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(target), bytes(arch.parts[arch.data[0]]).decode())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            item_type = field.types[1]
            if item_type == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(field.name, value)
        elif value_type == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], value_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        shape = [int(d) for d in reversed(tensor.shape)]
        writer.add_tensor(tensor.name, values.reshape(shape), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def run(gguf: str, extra: list[str], chats: list, max_tokens: int) -> dict:
    with start("llama.cpp", gguf, str(BINARY), 1, extra=extra) as server, httpx.Client(timeout=None) as http:
        body = {"model": "m", "max_tokens": max_tokens, "temperature": 0.0}
        http.post(server.base + "/v1/chat/completions", json={**body, "messages": FREE_CHATS[0], "max_tokens": 8})
        tokens, begun = 0, time.perf_counter()
        for chat in chats:  # timed without logprobs: asking for them may turn llama.cpp's speculation off
            out = http.post(server.base + "/v1/chat/completions", json={**body, "messages": chat}).json()
            tokens += out["usage"]["completion_tokens"]
        seconds = time.perf_counter() - begun
        logprobs = []
        for chat in chats:
            with_logprobs = {**body, "messages": chat, "logprobs": True, "top_logprobs": 1}
            out = http.post(server.base + "/v1/chat/completions", json=with_logprobs).json()
            logprobs.append([entry["logprob"] for entry in out["choices"][0]["logprobs"]["content"]])
        return {"tokens": tokens, "seconds": seconds, "logprobs": logprobs}


def abba(name: str, gguf: str, extra: list[str], chats: list, max_tokens: int) -> dict:
    runs = {"off": [], "on": []}
    for which in ("off", "on", "on", "off"):
        runs[which].append(run(gguf, extra if which == "on" else [], chats, max_tokens))
    rate = {w: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for w, rs in runs.items()}
    off_lp, on_lp = runs["off"][0]["logprobs"], runs["on"][0]["logprobs"]
    flat_on = [v for row in on_lp for v in row]
    return {
        "case": name,
        "off_tok_s": round(rate["off"], 1),
        "on_tok_s": round(rate["on"], 1),
        "ratio": round(rate["on"] / rate["off"], 3),
        "logprobs_equal_off": on_lp == off_lp,
        "logprobs_zero_share": round(sum(v == 0.0 for v in flat_on) / max(1, len(flat_on)), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", default="bench_out/speculative_llama_cpp.json")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    q4_1 = builtin_model_path("smollm2")
    f32 = str(write_f32_gguf(q4_1, Path("bench_out/smollm2-f32.gguf")))
    k = str(args.k)
    ngram = ["--spec-type", "ngram-simple", "--spec-draft-n-max", k]
    draft = ["--spec-type", "draft-simple", "-md", q4_1, "--spec-draft-n-max", k, "--spec-draft-n-min", "0"]
    cases = [
        ("ngram, copy chats, Q4_1, c1", q4_1, ngram, COPY_CHATS),
        ("ngram, free text, Q4_1, c1", q4_1, ngram, FREE_CHATS),
        ("draft Q4_1 for F32, every chat, c1", f32, draft, COPY_CHATS + FREE_CHATS),
    ]
    rows = []
    for name, gguf, extra, chats in cases:
        if args.only not in name:
            continue
        rows.append(abba(name, gguf, extra, chats, args.max_tokens))
        print(rows[-1], flush=True)
    print_table(rows, ["case", "off_tok_s", "on_tok_s", "ratio", "logprobs_equal_off", "logprobs_zero_share"])
    write_json(args.json, {"machine": machine(), "k": args.k, "rows": rows})


if __name__ == "__main__":
    main()
