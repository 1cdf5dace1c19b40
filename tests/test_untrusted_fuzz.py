"""A sample of the untrusted-input fuzzer (issue 62; the whole run is scripts/fuzz_untrusted.py, docs/testing.md):
one or a few mutations of each kind (GGUF header numbers, nested arrays, alignment, config values, the
tokenizer, the tensor list, a truncation, a NaN weight; config.json, safetensors headers and values, shard
names that leave the folder; LoRA configs and tensors; hostile chat templates; the hybrids' recurrent keys
and tensors in Qwen3-Next, LFM2 and Granite 4.0-H folders and GGUF files; issue 65's gpt-oss, OLMo 3, SmolLM3,
Exaone 4 and Gemma 4), each loaded as the engine loads it in one child process: each is refused with the engine's
ValueError (or loads) within 10 s and 512 MiB of growth, and afterwards a real engine in that process answers.
About 23 s on a quiet machine (issue 65's three, their three bases loaded once: about 2.5 s more)."""

from __future__ import annotations

import pytest
from untrusted_fuzz import FAILING, case_line, catalog, default_cache_dir, draw_cases, run_fuzz

pytestmark = pytest.mark.slow

SAMPLE = (
    "tensor count = 18446744073709551615",
    "'blk.0.attn_q.weight' dims[0] = 4294967295",
    "'output.weight' offset = 18446744073709551552",
    "an extra key nested 100000 arrays deep",
    "general.alignment = 3 (u32)",
    "llama.block_count = 10000000 (u32)",
    "llama.embedding_length = 2147483648 (u32)",
    "llama.attention.head_count = 4 (u32), llama.attention.head_count_kv = 3 (u32)",
    "llama.rope.freq_base = -10000.0 (f32)",
    "tokenizer.ggml.bos_token_id = 512 (u32)",
    "tokenizer.ggml.tokens: token 300 a copy of token 299",
    "tensor blk.0.attn_q.weight renamed 'blk.7.attn_q.weight'",
    "cut at the first tensor info",
    "token_embd.weight: value at byte 0 = nan",
    "config.json: num_hidden_layers = 18446744073709551617",
    "config.json: num_attention_heads = 8, num_key_value_heads = 3",
    "config.json: a list",
    "model.safetensors: header length 2^64-1",
    "model.safetensors: model.layers.0.self_attn.k_proj.weight data_offsets = [0, 9223372036854775808]",
    "model.safetensors: model.embed_tokens.weight[0] = nan",
    "model.safetensors.index.json: every tensor in ../x.safetensors",
    "tokenizer.json: not JSON",
    "adapter_config.json: r = 0",
    "adapter_config.json: lora_alpha = nan",
    "adapter_model.safetensors: base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight: B [257, 2], wider "
    "than q_proj",
    "adapter_model.safetensors: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: A[0, 0] = NaN",
    "a loop of 10^10 steps",
    "'x' * 10**9",
    # hybrids (issue 64): the Gated DeltaNet's and the short conv's keys and tensors
    "Qwen3-Next folder: config.json: linear_num_value_heads = 3",
    "Qwen3-Next folder: config.json: rope_parameters.partial_rotary_factor = -0.25",
    "Qwen3-Next folder: model.safetensors: model.layers.0.linear_attn.A_log shape [3], data_offsets to match",
    "Qwen3-Next GGUF: qwen3next.attention.recurrent_layers = [False, True] (bool array)",
    "Qwen3-Next GGUF: qwen3next.expert_used_count = 9 (u32)",
    "Qwen3-Next GGUF: tensor blk.0.ssm_ba.weight given dims [64, 7]",
    "Qwen3-Next GGUF: blk.0.ssm_a: value at byte 0 = 1.0",
    "LFM2 GGUF: lfm2.attention.head_count_kv = [2, 0] (u32 array)",
    # Granite 4.0-H: a multiplier infinite in float32, RoPE on part of each head (both loaded once)
    "Granite 4.0-H folder: config.json: embedding_multiplier = 1e+39",
    "Granite 4.0-H GGUF: granitehybrid.rope.scaling.finetuned = True (bool), granitehybrid.rope.dimension_count = 16 "
    "(u32)",
    # issue 65 (a base each, loaded once): an MXFP4 scale byte past the finite range in gpt-oss's GGUF, the sliding
    # layers' own base whose angles overflow (a crash the fuzzer found), Gemma 4 beyond its body
    "gpt-oss GGUF: blk.0.ffn_down_exps.weight: byte at byte 0 = 255",
    "OLMo 3 GGUF: olmo2.rope.freq_base_swa = 1e-45 (f32)",
    "Gemma 4 folder: config.json: hidden_size_per_layer_input = 256",
)


def sample_cases(bases) -> list:
    named = {mutation.description: (index, mutation) for index, mutation in enumerate(catalog())}
    return [named[description] for description in SAMPLE]


def test_the_sample_is_refused_within_the_limits_and_the_engine_serves_after():
    report = run_fuzz(sample_cases)
    assert len(report.results) == len(SAMPLE)
    failed = [case_line(r) for r in report.results if r.outcome in FAILING]
    assert not failed, "\n".join(failed)
    assert report.serving["ok"], report.serving


def test_random_cases_are_a_function_of_the_seed():
    from untrusted_fuzz_bases import make_bases

    bases = make_bases(default_cache_dir())
    first = len(catalog())

    def descriptions(seed: int) -> list[str]:
        return [mutation.description for _, mutation in draw_cases(bases, seed, 30, first)]

    assert descriptions(7) == descriptions(7)
    assert descriptions(7) != descriptions(8)
    kinds = {m.kind for _, m in draw_cases(bases, 7, 60, first)}
    assert kinds >= {"gguf-header", "hf-config", "lora", "template", "hybrid-config", "hybrid-gguf"}
