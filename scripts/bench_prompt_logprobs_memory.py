"""Memory of scoring long prompts with prompt_logprobs=20 (issue 43): what prompt logprobs add to a
request's peak memory does not grow with the prompt, because the vocabulary-wide logits exist 256
positions at a time (worker/sampling/prompt_logprobs.py) and a step holds at most
max_num_batched_tokens of activations.

    python scripts/bench_prompt_logprobs_memory.py        # SmolLM2, bench_out/prompt_logprobs_memory.json

For each prompt length (500 to 8,000 random ids: SmolLM2's context is 8,192 tokens, so not the 16k the
issue names) and with and without `prompt_logprobs=20`, a fresh process runs the engine in process
(1,024-token steps), warms it up, scores the prompt (`max_tokens=1`) and reports how far its peak RSS
(VmHWM) rose. The difference of the two is what prompt logprobs cost; the rest is the prompt's own KV
cache (46 KiB a token) and the step's activations, which any request of that length needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import machine, write_json  # noqa: E402

LENGTHS = (500, 1000, 2000, 4000, 8000)
PROBE = r"""
import json, random, sys
from frontend import LLM, SamplingParams
from protocol.builtin_model import builtin_model_path
length, k = int(sys.argv[1]), (None if sys.argv[2] == "none" else int(sys.argv[2]))
def peak():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
llm = LLM(builtin_model_path("smollm2"), multiprocess=False, max_num_batched_tokens=1024, max_logprobs=20,
          max_model_len=8192)
llm.generate([{"prompt_token_ids": [1000] * 8}], SamplingParams(max_tokens=1), use_tqdm=False)
before = peak()
rng = random.Random(0)
prompt = [rng.randrange(1000, 40000) for _ in range(length)]
out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
assert k is None or len(out[0].prompt_logprobs) == length
print(json.dumps({"growth": peak() - before}))
"""


def growth(length: int, k: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, str(length), k], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["growth"]


def main() -> None:
    results: dict = {"machine": machine(), "model": "SmolLM2-135M Q4_1", "prompt_logprobs": 20, "runs": []}
    for length in LENGTHS:
        without, with_k = growth(length, "none"), growth(length, "20")
        run = {"prompt tokens": length, "peak growth without MiB": round(without, 1),
               "peak growth with prompt_logprobs=20 MiB": round(with_k, 1),
               "prompt logprobs' own MiB": round(with_k - without, 1),
               "the prompt's KV cache MiB": round(length * 30 * 2 * 3 * 64 * 4 / 2**20, 1)}
        results["runs"].append(run)
        print(run, flush=True)
    write_json("bench_out/prompt_logprobs_memory.json", results)


if __name__ == "__main__":
    main()
