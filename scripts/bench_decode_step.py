"""One decode step at a batch of B requests against the time of that step's matrix products alone
(the same weights and shapes, measured in the same run): how far the engine is from this machine's
limit for the model's matmuls.

    python scripts/bench_decode_step.py --model builtin:small --batch 64 --context 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_common import machine, prompts_of_lengths, write_json  # noqa: E402

from engine_core.core import EngineCore  # noqa: E402
from frontend.engine_args import load_tokenizer, make_config  # noqa: E402
from protocol.messages import EngineCoreRequest  # noqa: E402
from protocol.sampling_params import SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="print a torch profiler table of one step")
    parser.add_argument("--json", default="bench_out/decode_step.json")
    return parser.parse_args()


def interleaved_times(core: EngineCore, batch: int, steps: int) -> tuple[float, float]:
    """Median time of a decode step and of its matrix products alone, measured turn about so that the
    machine's drifting speed affects both alike."""
    model = core.runner.model
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    step_times, matmul_times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        step_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.inference_mode():
            for x, w in zip(inputs, weights):
                F.linear(x, w)
        matmul_times.append(time.perf_counter() - start)
    return sorted(step_times)[steps // 2], sorted(matmul_times)[steps // 2]


def main() -> None:
    args = parse_args()
    config = make_config(args.model, {"max_num_seqs": args.batch, "max_num_batched_tokens": 4096})
    core = EngineCore(config)
    prompts = prompts_of_lengths(load_tokenizer(config.model), [args.context] * args.batch)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.steps * 3 + 100, ignore_eos=True, logprobs=args.logprobs
    )
    for i, prompt in enumerate(prompts):
        core.add_request(b"", EngineCoreRequest(str(i), prompt, params, 0.0))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()  # prefill
    interleaved_times(core, args.batch, 3)  # warm-up
    if args.profile:
        with torch.profiler.profile() as prof:
            core.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    step, matmul = interleaved_times(core, args.batch, args.steps)
    print(
        f"batch {args.batch}, context ~{args.context}: decode step {step * 1e3:.1f} ms, "
        f"its matmuls {matmul * 1e3:.1f} ms, ratio {step / matmul:.2f}"
    )
    write_json(
        args.json,
        {
            "args": vars(args),
            "machine": machine(),
            "step_ms": step * 1e3,
            "matmul_ms": matmul * 1e3,
            "ratio": step / matmul,
        },
    )


if __name__ == "__main__":
    main()
