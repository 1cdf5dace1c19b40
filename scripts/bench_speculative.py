"""Speculative decoding on the real SmolLM2: output tokens/s with speculation on over off, ABBA in one
run (engines A, B, B, A, each alone, in process; the ratio of the two sums), with the acceptance rate
(kept / proposed tokens) and the mean kept run per verified round (1 + kept / rounds).

`ratio` is end to end (prefill included: a copy chat's prompt is long and its answer short);
`decode_ratio` is the decoding alone (each request's tokens after its first over the time from its
first token to its last), what speculation changes. Cases (docs/speculative.md has the figures):
- ngram on copy-heavy chats (edit a code listing, answer by quoting a passage), single stream, on the
  Q4_1 file as loaded by default, and on its fp32 weights;
- ngram on free text, single stream (the adaptive back-off keeps it at its plain speed);
- the fp32 weights drafted by the Q4_1 file (`draft_model`), single stream, every chat;
- ngram at concurrency 16 (the copy and free chats, 4 of each twice).
Every request is greedy; each case's outputs with speculation are checked equal to those without
(tokens), so a figure never comes from different text.

    python scripts/bench_speculative.py [--max-tokens 160] [--k 8] [--draft-k 8] [--json bench_out/speculative.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, print_table, write_json  # noqa: E402

from coreserve import LLM, SamplingParams  # noqa: E402
from coreserve.protocol.builtin_model import builtin_model_path  # noqa: E402

CODE = '''def read_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
'''
PASSAGE = (
    "The committee's report, published on Tuesday, states: \"The city's water supply meets every national "
    "standard, but the pipes under the old town are more than a century old and must be replaced within "
    "ten years.\" The mayor responded: \"We will start the work next spring, street by street, and no "
    "household will be without water for more than a day.\""
)
COPY_CHATS = [
    [{"role": "user", "content": "Rename the variable config to settings in this code and show the whole code:\n" + CODE}],
    [{"role": "user", "content": PASSAGE + "\n\nQuote exactly what the report states and what the mayor responded."}],
]
FREE_CHATS = [
    [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
    [{"role": "user", "content": "Explain how bees make honey, in a few paragraphs."}],
]


def run(model: str, dtype: str, spec: dict | None, chats: list, concurrency: int, max_tokens: int) -> dict:
    extra = {} if spec is None else {"speculative_config": spec}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with LLM(model, multiprocess=False, dtype=dtype, num_kv_blocks=1024, **extra) as llm:
        llm.chat([FREE_CHATS[0]], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)  # warm
        before = llm.get_engine_stats()
        begun = time.perf_counter()
        if concurrency == 1:
            outputs = [llm.chat([chat], params, use_tqdm=False)[0] for chat in chats]
        else:
            outputs = llm.chat(chats, params, use_tqdm=False)
        seconds = time.perf_counter() - begun
        stats = llm.get_engine_stats()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    # decoding alone: each request's tokens after its first over the time from its first to its last
    decode_s = sum(o.metrics["finished_time"] - o.metrics["first_token_time"] for o in outputs)
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    kept = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    rounds = stats.spec_num_drafts - before.spec_num_drafts
    return {
        "tokens": tokens,
        "seconds": seconds,
        "decode_seconds": decode_s,
        "decode_tokens": sum(len(t) - 1 for t in tokens),
        "output_tokens": sum(len(t) for t in tokens),
        "drafted": drafted,
        "kept": kept,
        "rounds": rounds,
    }


def abba(name: str, model: str, dtype: str, spec: dict, chats: list, concurrency: int, max_tokens: int) -> dict:
    """Off, on, on, off: tokens/s of the two on runs over the two off runs."""
    runs = {"off": [], "on": []}
    for which in ("off", "on", "on", "off"):
        runs[which].append(run(model, dtype, None if which == "off" else spec, chats, concurrency, max_tokens))
    off, on = runs["off"], runs["on"]
    assert all(r["tokens"] == off[0]["tokens"] for r in off + on), f"{name}: speculation changed the tokens"
    rate = {w: sum(r["output_tokens"] for r in rs) / sum(r["seconds"] for r in rs) for w, rs in runs.items()}
    decode = {w: sum(r["decode_tokens"] for r in rs) / sum(r["decode_seconds"] for r in rs) for w, rs in runs.items()}
    drafted, kept, rounds = (sum(r[key] for r in on) for key in ("drafted", "kept", "rounds"))
    return {
        "case": name,
        "off_tok_s": round(rate["off"], 1),
        "on_tok_s": round(rate["on"], 1),
        "ratio": round(rate["on"] / rate["off"], 3),
        "decode_ratio": round(decode["on"] / decode["off"], 3),
        "acceptance": round(kept / drafted, 3) if drafted else None,
        "mean_kept_run": round(1 + kept / rounds, 2) if rounds else None,
        "output_tokens": on[0]["output_tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=8, help="ngram's num_speculative_tokens")
    parser.add_argument("--draft-k", type=int, default=8, help="the draft model's num_speculative_tokens")
    parser.add_argument("--json", default="bench_out/speculative.json")
    args = parser.parse_args()
    model = builtin_model_path("smollm2")
    ngram = {"method": "ngram", "num_speculative_tokens": args.k}
    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": args.draft_k}
    n = args.max_tokens
    cases = [
        ("ngram, copy chats, Q4_1, c1", "auto", ngram, COPY_CHATS, 1),
        ("ngram, copy chats, fp32, c1", "float32", ngram, COPY_CHATS, 1),
        ("ngram, free text, Q4_1, c1", "auto", ngram, FREE_CHATS, 1),
        ("draft Q4_1 for fp32, every chat, c1", "float32", draft, COPY_CHATS + FREE_CHATS, 1),
        ("ngram, copy and free chats, Q4_1, c16", "auto", ngram, (COPY_CHATS + FREE_CHATS) * 4, 16),
    ]
    rows = []
    for name, dtype, spec, chats, concurrency in cases:
        rows.append(abba(name, model, dtype, spec, chats, concurrency, n))
        print(rows[-1], flush=True)
    print_table(
        rows, ["case", "off_tok_s", "on_tok_s", "ratio", "decode_ratio", "acceptance", "mean_kept_run", "output_tokens"]
    )
    write_json(args.json, {"machine": machine(), "max_tokens": n, "k": args.k, "draft_k": args.draft_k, "rows": rows})


if __name__ == "__main__":
    main()
