"""One decode step at a batch of B requests against the time of that step's matrix products alone
(the same shapes and dtype, measured in the same run): how far the engine is from this machine's limit.

It also measures this machine's memory read bandwidth, turn about with the steps: a 1 GiB fp32 array
in huge pages (as the engine's weights are) read by torch's sum and by the kernels' two-stream read
(`stream_sum` in scripts/csrc/stream_read.c, the way the few-row products stream their weights), with all of torch's threads; the
faster of the two is the bandwidth. It reports the step against the bandwidth limit: the bytes of
weights a step reads (every linear layer's, lm_head included; one row of the embedding table) over
that bandwidth. At batch 1 that is the whole cost a step cannot avoid.

The step's matrix products are the linear layers (lm_head included) and attention's two per layer
(scores = Q K^T and scores V, run here as one batched product per layer over contiguous copies of
the same shapes). Both ratios are printed: against all of them, and against the linear layers alone.

    python scripts/bench_decode_step.py --model builtin:small --batch 64 --context 256
    python scripts/bench_decode_step.py --model builtin:small --batch 1 --context 128 --steps 30
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_common import machine, prompts_of_lengths, write_json  # noqa: E402
from stream_read import load_stream_sum  # noqa: E402

from coreserve.engine_core.core import EngineCore  # noqa: E402
from coreserve.frontend.engine.engine_args import load_tokenizer, make_config  # noqa: E402
from coreserve.protocol.messages import EngineCoreRequest  # noqa: E402
from coreserve.protocol.sampling_params import SamplingParams  # noqa: E402
from coreserve.worker.cpu.huge_pages import huge_page_bytes  # noqa: E402
from coreserve.worker.cpu.linear import linear  # noqa: E402


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
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="auto: a GGUF file's quantized weights kept in their blocks")
    parser.add_argument(
        "--no-cpu-kernels", action="store_true", help="torch's ops only (the path CUDA takes)"
    )
    parser.add_argument(
        "--no-batch-invariant", action="store_true", help="batch_invariant=False (shape-tuned products)"
    )
    parser.add_argument("--quantized-activations", default="float32", choices=["float32", "int8"],
                        help="int8: integer mode's products for GGUF blocks (docs/quantized.md)")
    parser.add_argument("--kernel-variant", default="auto",
                        help="the C kernels' build: auto, native, or a prebuilt level (docs/install.md)")
    parser.add_argument("--json", default="bench_out/decode_step.json")
    return parser.parse_args()


def attention_operands(model: torch.nn.Module, batch: int, context: int, dtype: torch.dtype) -> list[tuple]:
    """Per layer, random q [B * Hkv, G, D], keys and values [B * Hkv, L, D]: attention's products as one
    batched matmul each, over as many bytes as the step reads from its KV cache."""
    a = model.args
    group = a.num_heads // a.num_kv_heads
    operands = []
    like = {"dtype": dtype, "device": model.lm_head.weight.device}
    for _ in range(a.num_layers):
        keys = torch.randn(batch * a.num_kv_heads, context, a.head_dim, **like)
        operands.append(
            (
                torch.randn(batch * a.num_kv_heads, group, a.head_dim, **like),
                keys,
                torch.randn_like(keys),
            )
        )
    return operands


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: each linear layer's once (tied ones counted once)."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(w.numel() * w.element_size() for w in weights.values())


def time_read(read) -> float:
    """Seconds one read of the 1 GiB array takes."""
    start = time.perf_counter()
    read()
    return time.perf_counter() - start


def read_functions() -> dict[str, object]:
    """Reads of one 1 GiB fp32 array (in huge pages where the kernel grants them): torch's sum, and
    the C kernels' two-stream read where they are loaded."""
    memory = huge_page_bytes(2**30)
    array = (memory.view(torch.float32) if memory is not None else torch.empty(2**28)).fill_(1.0)
    reads = {"read_torch_sum": array.sum}
    stream_sum = load_stream_sum()
    if stream_sum is not None:
        threads = torch.get_num_threads()
        reads["read_two_streams"] = lambda: stream_sum(array.data_ptr(), array.numel(), threads)
    return reads


def wait(model: torch.nn.Module) -> None:
    """On a GPU the products are queued: wait for them before reading the clock. (A step waits by
    itself: it copies its sampled tokens to the host.)"""
    if model.lm_head.weight.device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_times(core: EngineCore, batch: int, steps: int) -> dict[str, float]:
    """Median times (s) of a decode step, of its linear layers alone, of its attention products alone
    and of reading 1 GiB each way, measured turn about so that the machine's drifting speed affects
    all alike."""
    model, backend = core.executor.model, core.executor.backend
    kernels = backend.kernels if backend.name == "cpu" else None  # the C kernels, CpuBackend's
    is_invariant = getattr(model.ops, "is_batch_invariant", False)  # CpuOps' choice of products
    dtype = core.executor.dtype  # the activations' and KV cache's (fp32 with the CPU kernels)
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch, m.in_features, dtype=dtype, device=m.weight.device) for m in layers]
    context = round(sum(r.num_tokens for r in core.scheduler.requests.values()) / batch) + steps // 2
    attention = attention_operands(model, batch, context, dtype)
    reads = read_functions()
    times: dict[str, list[float]] = {
        "step": [],
        "linear": [],
        "attention": [],
        **{name: [] for name in reads},
    }
    for _ in range(steps):
        for name, read in reads.items():
            times[name].append(time_read(read))
        start = time.perf_counter()
        core.step()
        times["step"].append(time.perf_counter() - start)
        with torch.inference_mode():
            start = time.perf_counter()
            for x, layer in zip(inputs, layers):
                linear(layer, x, kernels, is_invariant)  # the engine's own matmul call
            wait(model)
            times["linear"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for q, keys, values in attention:
                torch.bmm(torch.bmm(q, keys.transpose(1, 2)), values)
            wait(model)
            times["attention"].append(time.perf_counter() - start)
    return {name: sorted(values)[steps // 2] for name, values in times.items()}


def main() -> None:
    args = parse_args()
    config = make_config(
        args.model,
        {
            "max_num_seqs": args.batch,
            "max_num_batched_tokens": 4096,
            "can_use_cpu_kernels": not args.no_cpu_kernels,
            "dtype": args.dtype,
            "quantized_activations": args.quantized_activations,
            "batch_invariant": not args.no_batch_invariant,
            "kernel_variant": args.kernel_variant,
        },
    )
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
    times = interleaved_times(core, args.batch, args.steps)
    step, linear, attention = times["step"], times["linear"], times["attention"]
    read_rates = {name: 2**30 / seconds for name, seconds in times.items() if name.startswith("read_")}
    bandwidth, weight_bytes = max(read_rates.values()), weight_bytes_per_step(core.executor.model)
    limit = weight_bytes / bandwidth
    print(
        f"batch {args.batch}, context ~{args.context}: decode step {step * 1e3:.1f} ms, "
        f"linear layers {linear * 1e3:.1f} ms, attention products {attention * 1e3:.1f} ms\n"
        f"step / all matrix products: {step / (linear + attention):.2f}   "
        f"step / linear layers: {step / linear:.2f}\n"
        f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s (the faster of "
        + ", ".join(f"{name[5:]} {rate / 1e9:.1f}" for name, rate in read_rates.items())
        + f"); weights read per step "
        f"{weight_bytes / 1e6:.0f} MB: limit {limit * 1e3:.1f} ms a step, {1 / limit:.1f} steps/s\n"
        f"fraction of the bandwidth limit: step {limit / step:.2f}   linear layers {limit / linear:.2f}"
    )
    write_json(
        args.json,
        {
            "args": vars(args),
            "machine": machine(),
            "step_ms": step * 1e3,
            "linear_ms": linear * 1e3,
            "attention_products_ms": attention * 1e3,
            "ratio": step / (linear + attention),
            "ratio_linear_only": step / linear,
            "bandwidth_gb_s": bandwidth / 1e9,
            "read_rates_gb_s": {name[5:]: rate / 1e9 for name, rate in read_rates.items()},
            "weight_mb_per_step": weight_bytes / 1e6,
            "fraction_of_bandwidth_limit": limit / step,
            "linear_fraction_of_bandwidth_limit": limit / linear,
        },
    )


if __name__ == "__main__":
    main()
