"""Qwen3.5 at its 0.8B shape (random weights: no trained file is on the package index), the checks of
tests/test_hybrid_models.py at real sizes, and what a prompt and a decode step cost there:

- prompt logprobs within 1e-4 of transformers' forward (fp32), generation within 1e-4 of its `generate`;
- alone = batched (4 prompts of other lengths, 64-token chunks) and scoring = generation, bit for bit;
- the prompt rate (one 512-token prompt), c1 and c16 decode rates, and the recurrence's share of a
  prompt (csrc/recurrent_mixers.c timed alone on the prompt's shapes, against the whole prompt).

    python scripts/check_hybrid_shape.py [--layers 24] [--skip-hf]

Writes the checkpoint once under ~/.cache/coreserve/shapes/ (3 GB fp32).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Qwen3.5-0.8B's config.json (text_config), as the hub folder states it
SHAPE = dict(
    model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True, full_attention_interval=4,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
)


def write_checkpoint(folder: Path, num_layers: int) -> str:
    from conftest import real_tokenizer_path
    from gguf_fuzz_files import peaked_init
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").exists():
        return str(folder)
    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_path("llama3"))
    config = AutoConfig.for_model(**SHAPE, num_hidden_layers=num_layers, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():  # the tied table's logits spread as a trained model's
            param.copy_(0.1 * torch.randn_like(param) if "embed_tokens" in name else peaked_init(name, param))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def prompts_of(num: int, length: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1000, 100000, (max(4, length - 7 * (i % 4)),), generator=generator).tolist()}
            for i in range(num)]


def check_against_hf(path: str) -> dict[str, float]:
    """The worst |difference| of the listed logprobs: against HF's forward (its recurrence in chunks), against
    its `generate` (token by token, as here), and HF's forward against its own `generate` on the same
    tokens (what the two orders of one recurrence differ by)."""
    from conftest import hf_logprobs, load_hf
    from test_model_families import hf_generate_logprobs

    from coreserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    with LLM(path, multiprocess=False) as llm:
        outputs = llm.generate(prompts_of(2, 64, 1), params, use_tqdm=False)
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


def check_invariants(path: str) -> tuple[int, int]:
    from test_batch_invariance import sampled_rows, scoring_mismatches

    from coreserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompts = prompts_of(4, 96, 2)
    with LLM(path, multiprocess=False, max_num_batched_tokens=512) as llm:
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    with LLM(path, multiprocess=False, max_num_batched_tokens=64) as llm:
        batched = llm.generate(prompts, params, use_tqdm=False)
        scoring = sum(scoring_mismatches(llm, out) for out in batched)
    differ = sum(sampled_rows(a) != sampled_rows(b) or a.prompt_logprobs != b.prompt_logprobs
                 for a, b in zip(alone, batched))
    return differ, scoring


def rates(path: str) -> dict[str, float]:
    from coreserve import LLM, SamplingParams

    out = {}
    with LLM(path, multiprocess=False, max_num_batched_tokens=512) as llm:
        llm.generate(prompts_of(1, 32, 3), SamplingParams(max_tokens=4), use_tqdm=False)  # warm
        begun = time.perf_counter()
        llm.generate(prompts_of(1, 512, 4), SamplingParams(max_tokens=1), use_tqdm=False)
        out["prompt tok/s (512)"] = 512 / (time.perf_counter() - begun)
        for concurrency in (1, 16):
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            prompts = prompts_of(concurrency, 16, 5)
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
            begun = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            out[f"c{concurrency} tok/s (64 tokens, 16-token prompts)"] = 64 * concurrency / (time.perf_counter() - begun)
    return out


def recurrence_seconds(path: str, num_tokens: int) -> float:
    """The C mixer alone (conv, recurrence, gated norm) over num_tokens of one sequence, every recurrent layer."""
    from coreserve.worker.cpu.kernels import gated_deltanet, load_cpu_kernels
    from coreserve.worker.models.gated_deltanet import LayerState
    from coreserve.worker.models.loader import load_model
    from coreserve.worker.step.attention import StateSpan

    model = load_model(path, torch.float32, torch.device("cpu"))
    mixers = [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]
    lin, kernels = mixers[0].shape, load_cpu_kernels()
    proj = torch.randn(num_tokens, mixers[0].in_proj.out_features) * 0.1
    state = LayerState(torch.zeros(1, lin.conv_kernel - 1, lin.conv_dim),
                       torch.zeros(1, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim))
    begun = time.perf_counter()
    for mixer in mixers:
        gated_deltanet(kernels, mixer, proj, state, [StateSpan(0, num_tokens, 0)])
    return time.perf_counter() - begun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    cache = Path(os.environ.get("CORESERVE_CACHE", Path.home() / ".cache" / "coreserve")) / "shapes"
    path = write_checkpoint(cache / f"qwen3_5-0.8b-shape-{args.layers}l-v2", args.layers)
    print(f"host: {torch.get_num_threads()} threads; model: {path}")
    if not args.skip_hf:
        for name, value in check_against_hf(path).items():
            print(f"worst |logprob difference| (top 5 a row), {name}: {value:.2e}")
    differ, scoring = check_invariants(path)
    print(f"alone != batched: {differ} of 4 requests; scoring != generation: {scoring} tokens")
    for name, value in rates(path).items():
        print(f"{name}: {value:.1f}")
    share = recurrence_seconds(path, 512)
    print(f"the recurrent mixers alone over 512 prompt tokens: {share:.3f} s")


if __name__ == "__main__":
    main()
