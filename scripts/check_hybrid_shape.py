"""The hybrid families at a real small model's shape (scripts/hybrid_shapes.py: Qwen3.5-0.8B,
Qwen3-Next-80B-A3B's layers over 16 experts and 4 layers, LFM2-350M, Granite-4.0-H-350M; random weights:
no trained file is on the package index), the checks of tests/test_hybrid_models.py at real sizes, and
what a prompt and a decode step cost there:

- prompt logprobs within 1e-4 of transformers' forward (fp32), generation within 1e-4 of its `generate`;
- alone = batched (4 prompts of other lengths, 64-token chunks) and scoring = generation, bit for bit;
- one request's bits from a prefix-cache hit (its state restored from a snapshot), in multi-step windows and
  as each of n = 4 greedy children, against its plain run;
- the prompt rate (one 512-token prompt), c1 and c16 decode rates, and the recurrent mixers' share of a
  prompt (the CPU backend's mixer timed alone on the prompt's shapes, against the whole prompt);
- a sequence's recurrent state (what a state slot, and a prefix-cache snapshot, costs) beside the KV
  cache's bytes a token.

    python scripts/check_hybrid_shape.py [--family qwen3_5] [--layers N] [--experts 16] [--skip-hf] [--skip-rates]

Writes each checkpoint once under ~/.cache/coreserve/shapes/ (fp32: 1.3 to 3.7 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybrid_shapes import SHAPES, config_of, folder_of  # noqa: E402


def write_checkpoint(folder: Path, family: str, config: dict) -> str:
    from conftest import real_tokenizer_path
    from gguf_fuzz_files import peaked_init
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").exists():
        return str(folder)
    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_path("llama3"))
    bos, eos = SHAPES[family].token_ids or (tokenizer.bos_token_id, tokenizer.eos_token_id)
    config = AutoConfig.for_model(**config, bos_token_id=bos, eos_token_id=eos)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():  # the tied table's logits spread as a trained model's
            param.copy_(0.1 * torch.randn_like(param) if "embed_tokens" in name else peaked_init(name, param))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def prompts_of(num: int, length: int, seed: int, vocab_size: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    high = min(100000, vocab_size)  # the Qwen3.5 shape's range, LFM2's vocab below it
    lengths = [max(4, length - 7 * (i % 4)) for i in range(num)]
    return [{"prompt_token_ids": torch.randint(1000, high, (n,), generator=generator).tolist()}
            for n in lengths]


def check_against_hf(path: str, vocab_size: int) -> dict[str, float]:
    """The worst |difference| of the listed logprobs: against HF's forward (its recurrence in chunks), against
    its `generate` (token by token, as here), and HF's forward against its own `generate` on the same
    tokens (what the two orders of one recurrence differ by)."""
    from conftest import hf_logprobs, load_hf
    from test_model_families import hf_generate_logprobs

    from coreserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    with LLM(path, multiprocess=False) as llm:
        outputs = llm.generate(prompts_of(2, 64, 1, vocab_size), params, use_tqdm=False)
    hf, worst = load_hf(path), {"forward": 0.0, "generate": 0.0, "HF forward vs HF generate": 0.0}
    for output in outputs:
        prompt, completion = output.prompt_token_ids, output.outputs[0]
        forward = hf_logprobs(hf, prompt + completion.token_ids)
        for position, entries in enumerate(output.prompt_logprobs[1:], start=1):
            worst["forward"] = max([worst["forward"]] + [abs(lp.logprob - forward[position - 1, t].item())
                                                         for t, lp in entries.items()])
        generated = hf_generate_logprobs(hf, prompt, completion.token_ids)
        for step, entries in enumerate(completion.logprobs):
            worst["generate"] = max([worst["generate"]] + [abs(lp.logprob - generated[step, t].item())
                                                           for t, lp in entries.items()])
            row = forward[len(prompt) - 1 + step]
            worst["HF forward vs HF generate"] = max([worst["HF forward vs HF generate"]] + [
                abs(row[t].item() - generated[step, t].item()) for t in entries])
    del hf
    return worst


def check_invariants(path: str, vocab_size: int) -> tuple[int, int]:
    from test_batch_invariance import sampled_rows, scoring_mismatches

    from coreserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompts = prompts_of(4, 96, 2, vocab_size)
    with LLM(path, multiprocess=False, max_num_batched_tokens=512) as llm:
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    with LLM(path, multiprocess=False, max_num_batched_tokens=64) as llm:
        batched = llm.generate(prompts, params, use_tqdm=False)
        scoring = sum(scoring_mismatches(llm, out) for out in batched)
    differ = sum(sampled_rows(a) != sampled_rows(b) or a.prompt_logprobs != b.prompt_logprobs
                 for a, b in zip(alone, batched))
    return differ, scoring


def check_cache_and_windows(path: str, vocab_size: int) -> dict[str, int]:
    """One 96-token request's bits, plain, against: a prefix-cache hit (snapshots every 2 blocks, so that the
    hit lands at 64 tokens), multi-step windows of 4, and n = 4 greedy children; the count of differing requests."""
    from test_batch_invariance import sampled_rows

    from coreserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompt = prompts_of(1, 96, 6, vocab_size)[0]
    with LLM(path, multiprocess=False, enable_prefix_caching=False) as llm:
        plain = llm.generate([prompt], params, use_tqdm=False)[0]
    with LLM(path, multiprocess=False, state_snapshot_blocks=2, max_num_batched_tokens=64) as llm:
        llm.generate([prompt], params, use_tqdm=False)
        warm = llm.generate([prompt], params, use_tqdm=False)[0]
        children = llm.generate([prompt], SamplingParams(**{**_fields(params), "n": 4}), use_tqdm=False)[0]
    with LLM(path, multiprocess=False, num_scheduler_steps=4) as llm:
        windowed = llm.generate([prompt], params, use_tqdm=False)[0]
    same = {"prefix hit": warm, "multi-step windows": windowed}
    found = {name: int(sampled_rows(o) != sampled_rows(plain) or o.prompt_logprobs != plain.prompt_logprobs)
             for name, o in same.items()}
    found["prefix hit tokens"] = warm.num_cached_tokens or 0
    rows = [[(t, e) for t, e in zip(c.token_ids, c.logprobs)] for c in children.outputs]
    found["n = 4 children"] = sum(r != list(zip(plain.outputs[0].token_ids, plain.outputs[0].logprobs)) for r in rows)
    return found


def _fields(params) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


def rates(path: str, vocab_size: int) -> dict[str, float]:
    from coreserve import LLM, SamplingParams

    out = {}
    with LLM(path, multiprocess=False, max_num_batched_tokens=512) as llm:
        llm.generate(prompts_of(1, 32, 3, vocab_size), SamplingParams(max_tokens=4), use_tqdm=False)  # warm
        begun = time.perf_counter()
        llm.generate(prompts_of(1, 512, 4, vocab_size), SamplingParams(max_tokens=1), use_tqdm=False)
        out["prompt tok/s (512)"] = 512 / (time.perf_counter() - begun)
        for concurrency in (1, 16):
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            prompts = prompts_of(concurrency, 16, 5, vocab_size)
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
            begun = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - begun
            out[f"c{concurrency} tok/s (64 tokens, 16-token prompts)"] = 64 * concurrency / seconds
    return out


def one_slot(args, mixer: str):
    """A recurrent layer's state for one sequence, zeroed, shaped as coreserve/worker/kv_memory.py's slots."""
    from coreserve.worker.models.family import MAMBA2, SHORT_CONV
    from coreserve.worker.models.gated_deltanet import LayerState

    if mixer == SHORT_CONV:
        return LayerState(torch.zeros(1, args.short_conv.kernel - 1, args.hidden_size), None)
    if mixer == MAMBA2:
        m = args.mamba
        return LayerState(torch.zeros(1, m.conv_kernel - 1, m.conv_dim),
                          torch.zeros(1, m.num_heads, m.head_dim, m.state_size))
    lin = args.linear
    return LayerState(torch.zeros(1, lin.conv_kernel - 1, lin.conv_dim),
                      torch.zeros(1, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim))


def mixer_seconds(path: str, num_tokens: int) -> float:
    """The CPU backend's recurrent mixer alone (conv, recurrence, gated norm: csrc/recurrent_mixers.c for
    Gated DeltaNet and Mamba2, torch's for LFM2's short conv) over num_tokens of one sequence, every
    recurrent layer; in_proj and out_proj not counted."""
    from coreserve.worker.cpu.kernels import load_cpu_kernels
    from coreserve.worker.cpu.ops import CpuOps
    from coreserve.worker.models.loader import load_model
    from coreserve.worker.step.attention import StateSpan

    model, ops = load_model(path, torch.float32, torch.device("cpu")), CpuOps(load_cpu_kernels())
    layers = [layer for layer in model.layers if layer.spec.mixer != "attention"]
    mixer_kind = layers[0].spec.mixer
    mix = getattr(ops, mixer_kind)  # CpuOps.gated_deltanet / short_conv / mamba2, as the decoder calls them
    mixers = [layer.linear_attn or layer.conv or layer.mamba for layer in layers]
    proj = torch.randn(num_tokens, mixers[0].in_proj.out_features) * 0.1
    state = one_slot(model.args, mixer_kind)
    mix(mixers[0], proj[:8].contiguous(), state, [StateSpan(0, 8, 0)])  # warm: the C threads' first start
    begun = time.perf_counter()
    for mixer in mixers:
        mix(mixer, proj, state, [StateSpan(0, num_tokens, 0)])
    return time.perf_counter() - begun


def cache_bytes(path: str) -> tuple[int, int]:
    """(the recurrent state a sequence, the KV cache a token), fp32: the core's state slot and snapshot size
    (DecoderArgs.state_bytes_per_seq: coreserve/engine_core/hybrid_memory.py, get_engine_stats()) and
    coreserve/worker/kv_memory.py's bytes_per_block over its block size."""
    from coreserve.worker.models.config import DecoderArgs

    args = DecoderArgs.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    return args.state_bytes_per_seq, 2 * len(args.attention_layers) * args.num_kv_heads * args.head_dim * 4


def report_costs(path: str, vocab_size: int) -> None:
    measured = rates(path, vocab_size)
    for name, value in measured.items():
        print(f"{name}: {value:.1f}")
    state, kv = cache_bytes(path)
    print(f"state a sequence: {state} bytes ({state / 2**20:.2f} MiB); KV a token: {kv} bytes; a state "
          f"slot or snapshot costs what {state / max(kv, 1):.0f} tokens of KV do")
    seconds, prompt = mixer_seconds(path, 512), 512 / measured["prompt tok/s (512)"]
    print(f"the recurrent mixers alone over 512 prompt tokens: {seconds:.3f} s "
          f"({100 * seconds / prompt:.0f}% of the prompt's {prompt:.3f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="qwen3_5")
    parser.add_argument("--layers", type=int, help="default: the shape's (scripts/hybrid_shapes.py)")
    parser.add_argument("--experts", type=int, help="Qwen3-Next's experts (default 16)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-rates", action="store_true", help="the checks alone: no rates, no mixer timing")
    args = parser.parse_args()
    num_layers = args.layers or SHAPES[args.family].num_layers
    config = config_of(args.family, num_layers, args.experts)
    cache = Path(os.environ.get("CORESERVE_CACHE", Path.home() / ".cache" / "coreserve")) / "shapes"
    path = write_checkpoint(cache / folder_of(args.family, num_layers, args.experts), args.family, config)
    vocab_size = config["vocab_size"]
    print(f"host: {torch.get_num_threads()} threads; model: {path}")
    if not args.skip_hf:
        for name, value in check_against_hf(path, vocab_size).items():
            print(f"worst |logprob difference| (top 5 a row), {name}: {value:.2e}")
    differ, scoring = check_invariants(path, vocab_size)
    print(f"alone != batched: {differ} of 4 requests; scoring != generation: {scoring} tokens")
    for name, value in check_cache_and_windows(path, vocab_size).items():
        print(f"{name}: {value}" + ("" if "tokens" in name else " differing from the plain run"))
    if not args.skip_rates:
        report_costs(path, vocab_size)


if __name__ == "__main__":
    main()
