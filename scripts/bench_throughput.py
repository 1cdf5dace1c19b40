"""Offline throughput: the engine with and without logprobs, and Hugging Face `generate`, on the same
prompts and output lengths, alternated in one run. Prints output tokens/s and ratios; writes JSON.

    python scripts/bench_throughput.py --model builtin:small --configs engine,engine-lp5,hf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    machine,
    median,
    print_table,
    prompts_of_lengths,
    sharegpt_like_lengths,
    timed,
    write_json,
)

from coreserve import LLM, SamplingParams  # noqa: E402

ENGINE_CONFIGS = {
    "engine": {},
    "engine-lp5": {"logprobs": 5},
    "engine-lp20": {"logprobs": 20},
    "engine-plp5": {"prompt_logprobs": 5},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--configs", default="engine,engine-lp5,engine-lp20,engine-plp5,hf")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument(
        "--workload",
        choices=["sharegpt", "fixed"],
        default="sharegpt",
        help="sharegpt: long-tailed lengths (means 215 in, 128 out); fixed: --input-len/--output-len",
    )
    parser.add_argument("--input-len", type=int, default=215)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-output-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--inproc", action="store_true", help="run the engine core in this process")
    parser.add_argument("--json", default="bench_out/throughput.json")
    return parser.parse_args()


def run_engine(llm: LLM, prompts, output_lens, extra: dict) -> int:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **extra) for n in output_lens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def run_hf(model, tokenizer, prompts, output_lens, batch_size: int) -> int:
    """Batches of `batch_size`, left-padded; each batch runs to its longest requested output, and only
    the requested tokens count (what a user of `generate` gets for the same work)."""
    import torch

    for start in range(0, len(prompts), batch_size):
        batch, lens = prompts[start : start + batch_size], output_lens[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[tokenizer.eos_token_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                pad_token_id=tokenizer.eos_token_id,
            )
    return int(sum(output_lens))


def main() -> None:
    args = parse_args()
    configs = args.configs.split(",")
    llm = LLM(args.model, multiprocess=not args.inproc, dtype=args.dtype)
    tokenizer = llm.get_tokenizer()
    if args.workload == "sharegpt":
        input_lens, output_lens = sharegpt_like_lengths(args.num_prompts, max_output=args.max_output_len)
    else:
        input_lens, output_lens = [args.input_len] * args.num_prompts, [args.output_len] * args.num_prompts
    prompts = prompts_of_lengths(tokenizer, input_lens)
    hf = None
    if "hf" in configs:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=getattr(torch, args.dtype)).eval()
    run_engine(llm, prompts[:4], [8] * 4, {})  # warm-up
    times: dict[str, list[float]] = {c: [] for c in configs}
    tokens: dict[str, int] = {}
    for round_index in range(args.rounds):
        for config in configs if round_index % 2 == 0 else configs[::-1]:  # ABBA: drift hits all alike
            if config == "hf":
                seconds, count = timed(lambda: run_hf(hf, tokenizer, prompts, output_lens, args.num_prompts))
            else:
                seconds, count = timed(
                    lambda c=config: run_engine(llm, prompts, output_lens, ENGINE_CONFIGS[c])
                )
            times[config].append(seconds)
            tokens[config] = count
            print(f"  {config}: {count} tokens in {seconds:.2f} s", flush=True)
    llm.shutdown()
    rows = []
    for config in configs:
        rate = tokens[config] / median(times[config])
        row = {
            "config": config,
            "output_tokens": tokens[config],
            "median_s": median(times[config]),
            "tokens_per_s": rate,
        }
        if "engine" in configs:  # paired: each round's ratio to the engine run next to it, then the median
            row["ratio_vs_engine"] = median([e / t for e, t in zip(times["engine"], times[config])])
        rows.append(row)
    print_table(rows, ["config", "output_tokens", "median_s", "tokens_per_s", "ratio_vs_engine"])
    if "engine" in configs and "hf" in configs:
        print(f"engine / HF generate: {1 / rows[configs.index('hf')]['ratio_vs_engine']:.2f}x")
    write_json(args.json, {"args": vars(args), "machine": machine(), "rows": rows, "times": times})


if __name__ == "__main__":
    main()
