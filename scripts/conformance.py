"""Conformance of coreserve on real GGUF files: the engine's promise checked on a file a user points at.

    python scripts/conformance.py FILE.gguf [FILE.gguf ...]
    python scripts/conformance.py gemma3-270m qwen2.5-coder-0.5b smollm2-135m   # scripts/real_models.py's
    python scripts/conformance.py FILE.gguf --json out.json --no-hf
    python scripts/conformance.py qwen35-f32.gguf --hf-folder FOLDER   # (b) on the folder the file came from

For each file, greedy generation with `logprobs=K` and `prompt_logprobs=K` over a few prompts (one past
a prefill chunk), each prompt alone and all of them batched with chunked prefill:

  (a) bits    the file kept quantized (the default dtype) against the same file dequantized to fp32 at
              load (`dtype="float32"`): every token id and every prompt and sample logprob equal bit for
              bit, alone and batched; and each run's batched answers equal its answers alone.
  (b) HF      the fp32 run against Hugging Face transformers' GGUF loader on the same file (fp32),
              teacher-forced over the engine's sequences (tests/hf_reference.py, cached on disk): the
              largest |difference| of every listed logprob, relative to max(1, |logprob|); bound 1e-4.
              Greedy tokens that are not HF's argmax are counted (a near tie may legitimately differ).
              Where transformers' loader cannot read the file's architecture (5.25: qwen35, qwen3next,
              granitehybrid), transformers on the HF folder an F32/F16/BF16 file came from (--hf-folder)
              instead; with no folder, or a quantized file, (b) is reported as not run, with the reason
              (neither a failure nor a pass).
  (c) llama   where scripts/build_llama_server.sh has built llama-server: its greedy tokens from the
              same prompt ids, how many of the first N equal coreserve's, and how many of its top-5
              candidates coreserve's top-5 share (reported, not required: llama.cpp computes otherwise).

Prints a table to paste into an issue; exits 1 when (a) or (b) fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # hf_reference: HF's teacher-forced answers, cached
from real_models import MODELS, SMOLLM2, fetch  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "In the beginning of the nineteenth century, the city of London was a place of great contrasts. On one "
    "side of the river stood the houses of merchants and bankers; on the other, the workshops, docks and "
    "crowded lanes where most of its people lived and worked. Visitors who came from the countryside",
    "Question: What is 17 times 3?\nAnswer:",
]
HF_BOUND = 1e-4
CHUNK_TOKENS = 32  # the batched run's token budget: the long prompt is prefilled in chunks
_FLOAT_TYPES = (0, 1, 30)  # ggml's F32, F16, BF16: a file of these holds the values of the folder it came from


def run_engine(path: str, dtype: str, max_tokens: int, k: int) -> dict:
    """Each prompt alone, then all batched under a small token budget: per prompt, its prompt ids, the
    prompt logprob rows and the sampled tokens with their rows (each row: [[token id, logprob], ...])."""
    from coreserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k,
                            ignore_eos=True)
    answers = {}
    for layout, budget in (("alone", None), ("batched", CHUNK_TOKENS)):
        extra = {} if budget is None else {"max_num_batched_tokens": budget}
        started = time.perf_counter()
        with LLM(path, dtype=dtype, multiprocess=False, max_model_len=1024, **extra) as llm:
            if layout == "alone":
                outs = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
            else:
                outs = llm.generate(PROMPTS, params, use_tqdm=False)
        answers[layout] = [_answer(out) for out in outs]
        answers[f"{layout}_seconds"] = time.perf_counter() - started
    return answers


def _answer(out) -> dict:
    completion = out.outputs[0]
    rows = lambda dicts: [[[t, lp.logprob] for t, lp in d.items()] for d in dicts]  # noqa: E731
    return {"prompt_ids": list(out.prompt_token_ids), "prompt_rows": rows(out.prompt_logprobs[1:]),
            "token_ids": list(completion.token_ids), "rows": rows(completion.logprobs), "text": completion.text}


def bits_equal(a: list[dict], b: list[dict]) -> tuple[bool, float]:
    """Whether two runs' answers are the same bits, and their largest |difference| when not."""
    if [x["token_ids"] for x in a] != [y["token_ids"] for y in b]:
        return False, math.inf
    worst, same = 0.0, True
    for x, y in zip(a, b):
        for rx, ry in zip(x["prompt_rows"] + x["rows"], y["prompt_rows"] + y["rows"]):
            same &= rx == ry
            worst = max([worst] + [abs(p[1] - q[1]) if p[0] == q[0] else math.inf for p, q in zip(rx, ry)])
    return same, worst


def hf_reference(path: str, hf_folder: str | None) -> tuple[object | None, str]:
    """(b)'s reference and what it is: transformers' GGUF loader on the file where it reads the file's
    architecture, else transformers on `hf_folder` (the folder the file came from); (None, why) where neither."""
    from hf_reference import HFReference, file_digest, gguf_reference
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from coreserve.protocol.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    arch = str(header.metadata.get("general.architecture"))
    # transformers' names of the MoE architectures (qwen2moe, qwen3moe) are qwen2_moe, qwen3_moe
    if arch.replace("moe", "_moe") in GGUF_SUPPORTED_ARCHITECTURES or arch in GGUF_SUPPORTED_ARCHITECTURES:
        return gguf_reference(path), "transformers' GGUF loader"
    if hf_folder is None:
        return None, f"not run: transformers' GGUF loader cannot read {arch} files (give --hf-folder)"
    if any(t.ggml_type not in _FLOAT_TYPES for t in header.tensors):
        return None, "not run: a quantized file does not hold its folder's values (--hf-folder needs F32/F16/BF16)"
    files = sorted(p for p in Path(hf_folder).iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
    key = "folder:" + ":".join(f"{p.name}={file_digest(str(p))}" for p in files)
    return HFReference(key, lambda: hf_folder), f"transformers on {Path(hf_folder).name}"


def hf_distance(reference, answers: list[dict]) -> dict:
    """fp32 answers against HF teacher-forced on the same sequences: the largest relative |difference|
    over every listed prompt and sample logprob, and the greedy tokens that are not HF's argmax."""
    sequences, wanted = [], []
    for a in answers:
        full = a["prompt_ids"] + a["token_ids"]
        rows = {r: [t for t, _ in row] for r, row in enumerate(a["prompt_rows"])}  # row r predicts r + 1
        start = len(a["prompt_ids"]) - 1
        rows.update({start + i: [t for t, _ in row] for i, row in enumerate(a["rows"])})
        sequences.append(full[: start + len(a["rows"])])
        wanted.append(rows)
    theirs = reference.teacher_forced(sequences, wanted)
    worst, not_argmax = 0.0, 0
    for a, scores in zip(answers, theirs):
        start = len(a["prompt_ids"]) - 1
        listed = list(enumerate(a["prompt_rows"])) + [(start + i, row) for i, row in enumerate(a["rows"])]
        for r, row in listed:
            for t, lp in row:
                ref = scores[r].logprobs[t]
                worst = max(worst, abs(lp - ref) / max(1.0, abs(ref)))
        not_argmax += sum(scores[start + i].argmax != t for i, t in enumerate(a["token_ids"]))
    return {"hf_max_rel": worst, "hf_not_argmax": not_argmax}


def llama_agreement(path: str, answers: list[dict], max_tokens: int) -> dict | None:
    """llama-server's greedy tokens on the same prompt ids: equal leading tokens, shared top-5."""
    from bench_llama_cpp import LLAMA_SERVER, start

    if not LLAMA_SERVER.exists():
        return None
    import httpx

    same, total, shared, listed = 0, 0, 0, 0
    with start("llama.cpp", path, str(LLAMA_SERVER), 1) as server:
        for a in answers:
            body = {"prompt": a["prompt_ids"], "n_predict": max_tokens, "temperature": 0.0, "n_probs": 5,
                    "post_sampling_probs": False}
            probs = httpx.post(server.base + "/completion", json=body, timeout=None).json()["completion_probabilities"]
            ids = [p["id"] for p in probs]
            lead = next((i for i, (x, y) in enumerate(zip(ids, a["token_ids"])) if x != y), len(ids))
            same, total = same + lead, total + len(ids)
            for p, row in zip(probs[:lead], a["rows"][:lead]):
                ours = {t for t, _ in sorted(row, key=lambda r: -r[1])[:5]}
                shared += len(ours & {c["id"] for c in p["top_logprobs"]})
                listed += 5
    return {"llama_same_tokens": f"{same}/{total}", "llama_top5_shared": f"{shared}/{listed}"}


def check(path: str, max_tokens: int, k: int, hf: bool, llama: bool, hf_folder: str | None = None) -> dict:
    quantized = run_engine(path, "auto", max_tokens, k)
    fp32 = run_engine(path, "float32", max_tokens, k)
    result = {"file": Path(path).name, "tokens": sum(len(a["prompt_ids"]) + len(a["token_ids"]) for a in fp32["alone"])}
    for name, (x, y) in {"quantized==fp32 alone": (quantized["alone"], fp32["alone"]),
                         "quantized==fp32 batched": (quantized["batched"], fp32["batched"]),
                         "alone==batched quantized": (quantized["alone"], quantized["batched"]),
                         "alone==batched fp32": (fp32["alone"], fp32["batched"])}.items():
        same, worst = bits_equal(x, y)
        result[name] = same
        result[name + " max diff"] = worst
    result["seconds quantized / fp32"] = f"{quantized['alone_seconds']:.1f} / {fp32['alone_seconds']:.1f}"
    reference, result["hf_reference"] = hf_reference(path, hf_folder) if hf else (None, "not run: --no-hf")
    if reference is not None:
        result.update(hf_distance(reference, fp32["alone"]))
    if llama and (agreement := llama_agreement(path, quantized["alone"], max_tokens)) is not None:
        result.update(agreement)
    result["ok"] = all(result[n] for n in result if "==" in n and "max diff" not in n) and (
        reference is None or result["hf_max_rel"] <= HF_BOUND)
    result["greedy"] = [a["text"] for a in quantized["alone"]]
    return result


def print_table(results: list[dict]) -> None:
    columns = ["file", "tokens", "quantized==fp32 alone", "quantized==fp32 batched", "alone==batched quantized",
               "alone==batched fp32", "hf_reference", "hf_max_rel", "hf_not_argmax", "llama_same_tokens",
               "llama_top5_shared", "ok"]
    shown = [c for c in columns if any(c in r for r in results)]
    print("| " + " | ".join(shown) + " |")
    print("|" + "---|" * len(shown))
    for r in results:
        cells = [f"{r[c]:.2e}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in shown]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help=f"GGUF files, or names of {[SMOLLM2.name, *MODELS]}")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true", help="skip (b)")
    parser.add_argument("--hf-folder", default=None, help="(b)'s reference where transformers cannot read the "
                        "file: the Hugging Face folder it came from (one file only)")
    parser.add_argument("--no-llama", action="store_true", help="skip (c)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.hf_folder is not None and (len(args.files) != 1 or not (Path(args.hf_folder) / "config.json").is_file()):
        parser.error("--hf-folder needs one file and a folder with a config.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    for name in args.files:
        path = str(fetch(name)) if name in MODELS or name == SMOLLM2.name else name
        results.append(check(path, args.max_tokens, args.logprobs, not args.no_hf, not args.no_llama, args.hf_folder))
        print(json.dumps({k: v for k, v in results[-1].items()}, default=str), file=sys.stderr)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
