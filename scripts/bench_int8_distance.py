"""What integer mode costs in numbers, beside what llama.cpp's arithmetic costs (issue 51): on the same
positions of each GGUF file, the distance of coreserve's integer mode (quantized_activations="int8")
from exact mode, and of llama-server from exact mode.

    scripts/build_llama_server.sh            # once
    python scripts/bench_int8_distance.py ~/.cache/coreserve/real/*.gguf builtin:smollm2

For each prompt llama-server writes its greedy continuation (`--tokens` tokens, its `n_probs` top
`--top` logprobs at each, before sampling). That sequence is then scored by coreserve in exact mode and
in integer mode (prompt logprobs, the top `--top` at each position), so all three are read at the same
positions with the same context. At each generated position, against exact mode's distribution E:

- KL(E || other) over E's top `--top` tokens: sum of p_E (log p_E - log p_other); a token missing from
  the other's top list is given the other's smallest listed logprob (so the figure errs low);
- |logprob| distance of the position's token (the one llama.cpp chose);
- agreement: the other's most likely token is E's.

Reported per file: mean and max KL, mean and max distance, agreement, for integer mode and llama.cpp.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, write_json  # noqa: E402
from bench_llama_cpp import LLAMA_SERVER, PROMPTS, gguf_path, start  # noqa: E402

from coreserve.frontend.llm import LLM  # noqa: E402
from coreserve.protocol.sampling_params import SamplingParams  # noqa: E402


def llama_rows(base: str, prompt: str, tokens: int, top: int) -> tuple[list[int], list[int], list[dict[int, float]]]:
    """llama-server's prompt ids, its greedy ids, and each position's top logprobs {id: logprob}."""
    prompt_ids = httpx.post(base + "/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    body = {"prompt": prompt_ids, "n_predict": tokens, "temperature": 0.0, "n_probs": top,
            "post_sampling_probs": False, "ignore_eos": True}
    out = httpx.post(base + "/completion", json=body, timeout=None).json()
    rows = out["completion_probabilities"]
    return prompt_ids, [r["id"] for r in rows], [{e["id"]: e["logprob"] for e in r["top_logprobs"]} for r in rows]


def coreserve_rows(llm: LLM, prompt_ids: list[int], ids: list[int], top: int) -> list[dict[int, float]]:
    """Each generated position's top logprobs (and the token's) from scoring prompt + ids."""
    out = llm.generate([{"prompt_token_ids": prompt_ids + ids}], SamplingParams(max_tokens=1, prompt_logprobs=top),
                       use_tqdm=False)[0]
    return [{t: e.logprob for t, e in row.items()} for row in out.prompt_logprobs[len(prompt_ids) :]]


def compare(exact: list[dict[int, float]], other: list[dict[int, float]], ids: list[int]) -> dict:
    kls, gaps, agree = [], [], 0
    for e_row, o_row, token in zip(exact, other, ids):
        floor = min(o_row.values())
        top_e = sorted(e_row, key=e_row.get, reverse=True)
        kls.append(sum(math.exp(e_row[t]) * (e_row[t] - o_row.get(t, floor)) for t in top_e))
        gaps.append(abs(e_row[token] - o_row[token]) if token in o_row else float("nan"))
        agree += max(o_row, key=o_row.get) == top_e[0]
    finite = [g for g in gaps if not math.isnan(g)]
    return {"positions": len(kls), "KL mean": sum(kls) / len(kls), "KL max": max(kls),
            "|logprob| mean": sum(finite) / len(finite), "|logprob| max": max(finite),
            "top-1 agreement": agree / len(kls)}


def measure(path: str, args: argparse.Namespace) -> dict:
    with start("llama.cpp", path, args.llama_server, 1) as server:
        rows = [llama_rows(server.base, prompt, args.tokens, args.top) for prompt in PROMPTS[: args.prompts]]
    scored = {}
    for mode in ("float32", "int8"):
        with LLM(path, quantized_activations=mode, max_logprobs=max(20, args.top)) as llm:
            scored[mode] = [coreserve_rows(llm, p, ids, args.top) for p, ids, _ in rows]
    ids = [t for _, generated, _ in rows for t in generated]
    exact = [r for rows_of in scored["float32"] for r in rows_of]
    return {
        "int8 vs exact": compare(exact, [r for rows_of in scored["int8"] for r in rows_of], ids),
        "llama.cpp vs exact": compare(exact, [r for _, _, theirs in rows for r in theirs], ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="GGUF files, or builtin:smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--llama-server", default=str(LLAMA_SERVER))
    parser.add_argument("--json", default="bench_out/int8_distance.json")
    args = parser.parse_args()
    results: dict = {"machine": machine(), "args": vars(args), "files": {}}
    for model in args.models:
        path = gguf_path(model)
        results["files"][Path(path).name] = figures = measure(path, args)
        for name, row in figures.items():
            print(f"{Path(path).name:48s} {name:20s} " + "  ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
        write_json(args.json, results)


if __name__ == "__main__":
    main()
