"""The hybrid families of the GGUF differential fuzzer (tests/gguf_fuzz.py): random Hugging Face configs of
Qwen3.5, Qwen3-Next, LFM2 and Granite 4.0-H (dense), whose GGUF files llama.cpp's own converter writes
(tests/gguf_fuzz_convert.py). Drawn from the seed: the layers' kinds (2 to 4 layers, at least one recurrent
and one attention layer, in any order), head counts and sizes, the recurrent mixers' sizes (Gated DeltaNet's
linear_* heads, LFM2's conv kernel, Mamba2's heads, groups, state and kernel), MLP and hidden widths that are
and are not multiples of 256, tied or untied outputs, biases where the family has them.

The vocabulary is the GPT-2 tokenizer's (one the converter knows), padded to a multiple of 8 as Mamba2's
converter pads it: the converter needs a tokenizer it recognises, whatever the model.
"""

from __future__ import annotations

import numpy as np

HYBRID_FAMILIES = ("qwen3_5", "qwen3_next", "lfm2", "granitemoehybrid")
GPT2_EOS = 50256  # <|endoftext|>, the GPT-2 tokenizer's last token
VOCABS = (50264, 50304, 50432)  # GPT-2's 50,257 tokens padded
_HIDDEN = (96, 160, 224, 256, 320, 512)


def draw_hybrid_config(rng: np.random.Generator, family: str, needs_k_rows: bool) -> dict:
    """A Hugging Face config of `family` (model_type included); `needs_k_rows`: the MLP widths multiples of
    256, so that K-quant types fit the down projections whatever the hidden width."""
    hidden = int(rng.choice(_HIDDEN))
    num_layers = int(rng.integers(2, 5))
    vocab = int(rng.choice(VOCABS))
    config = dict(
        hidden_size=hidden, num_hidden_layers=num_layers, vocab_size=vocab, bos_token_id=GPT2_EOS,
        eos_token_id=GPT2_EOS, max_position_embeddings=256, tie_word_embeddings=bool(rng.random() < 0.5),
        hidden_act="silu", intermediate_size=_width(rng, needs_k_rows),
    )
    eps = float(np.float32(rng.choice([1e-5, 1e-6])))  # GGUF keeps it as a float32
    theta = float(rng.choice([10000.0, 1000000.0]))
    config.update(_DRAWS[family](rng, config, needs_k_rows, eps, theta))
    return config


def hub_config(config: dict) -> dict:
    """config.json as the hub's folders have it, which the converter reads: Granite's layer kinds by their
    hub names (`mamba`, `attention`; transformers saves its own, which the converter takes for none)."""
    if config.get("model_type") != "granitemoehybrid":
        return config
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    return {**config, "layer_types": [names.get(kind, kind) for kind in config["layer_types"]]}


def scales_by_one_plus(config: dict, name: str) -> bool:
    """Whether HF's parameter `name` is a norm that scales by 1 + weight (Qwen3.5's and Qwen3-Next's, but the
    Gated DeltaNet's gated norm): the fuzzer draws it about 0, so that the scale is about 1 as the other
    families' (at about 2, a tied model's logits spread 25 wide, where HF's own fp32 runs are 1e-4 apart)."""
    return config["model_type"] in ("qwen3_5_text", "qwen3_next") and name.endswith("norm.weight") and (
        "linear_attn.norm" not in name)


def layer_kinds(rng: np.random.Generator, num_layers: int, recurrent: str, attention: str) -> list[str]:
    """Each layer's kind, at least one of each (coreserve refuses a model without attention; Granite's
    converter writes a file without Mamba2 layers as another architecture)."""
    kinds = [recurrent if rng.random() < 0.6 else attention for _ in range(num_layers)]
    first, second = rng.choice(num_layers, 2, replace=False)
    kinds[first], kinds[second] = recurrent, attention
    return kinds


def _width(rng: np.random.Generator, needs_k_rows: bool) -> int:
    return int(rng.choice((256, 512, 768) if needs_k_rows else (64, 96, 128, 192, 256, 352, 512)))


def _attention_heads(rng: np.random.Generator, hidden: int) -> tuple[int, int, int]:
    """(heads, KV heads, head size) with heads x head size = hidden (LFM2's and Granite's rule)."""
    head_dim = int(rng.choice([d for d in (16, 32, 64) if hidden % d == 0 and hidden // d <= 16]))
    num_heads = hidden // head_dim
    return num_heads, int(rng.choice([k for k in range(1, num_heads + 1) if num_heads % k == 0])), head_dim


def _qwen3_5(rng, config, needs_k_rows, eps, theta) -> dict:
    """Gated DeltaNet layers (key heads serving 1 to 3 value heads each: the converter tiles the value heads
    where more than 1, and a value head of 16 splits a 32-block) and output-gated attention rotating part of
    each head (its own head size, any head count)."""
    num_heads = int(rng.integers(1, 9))
    num_key_heads = int(rng.integers(1, 5))
    return dict(
        model_type="qwen3_5_text", rms_norm_eps=eps, head_dim=int(rng.choice([16, 32, 64])),
        num_attention_heads=num_heads,
        num_key_value_heads=int(rng.choice([k for k in range(1, num_heads + 1) if num_heads % k == 0])),
        layer_types=layer_kinds(rng, config["num_hidden_layers"], "linear_attention", "full_attention"),
        linear_num_key_heads=num_key_heads, linear_num_value_heads=num_key_heads * int(rng.integers(1, 4)),
        linear_key_head_dim=int(rng.choice([16, 32, 64])), linear_value_head_dim=int(rng.choice([16, 32, 64])),
        linear_conv_kernel_dim=int(rng.integers(2, 5)), attention_bias=bool(rng.random() < 0.3),
        rope_parameters=dict(rope_type="default", rope_theta=theta,
                             partial_rotary_factor=float(rng.choice([0.25, 0.5, 1.0]))),
    )


def _qwen3_next(rng, config, needs_k_rows, eps, theta) -> dict:
    """Qwen3.5's layers over 4 or 8 experts (1 to 3 a token, renormalised: a GGUF has no key to say
    otherwise) and a gated shared expert."""
    keys = _qwen3_5(rng, config, needs_k_rows, eps, theta)
    expert_widths = (256,) if needs_k_rows else (32, 64, 96, 256)
    keys.update(model_type="qwen3_next", num_experts=int(rng.choice([4, 8])),
                num_experts_per_tok=int(rng.integers(1, 4)), norm_topk_prob=True,
                moe_intermediate_size=int(rng.choice(expert_widths)),
                shared_expert_intermediate_size=int(rng.choice((256, 512) if needs_k_rows else (48, 64, 96, 256))))
    return keys


def _lfm2(rng, config, needs_k_rows, eps, theta) -> dict:
    """Gated short convolutions (kernel 2 to 4) and attention with per-head q/k norms; the MLP's width
    auto-adjusted (2/3, times a multiplier, rounded up to a multiple) or as given. No conv biases: llama.cpp's
    converter squeezes every `conv.conv` tensor as a kernel, and fails on the bias."""
    num_heads, kv_heads, _ = _attention_heads(rng, config["hidden_size"])
    multiple = 256 if needs_k_rows else int(rng.choice([32, 64, 256]))
    return dict(
        model_type="lfm2", norm_eps=eps, num_attention_heads=num_heads, num_key_value_heads=kv_heads,
        layer_types=layer_kinds(rng, config["num_hidden_layers"], "conv", "full_attention"),
        conv_L_cache=int(rng.integers(2, 5)), conv_bias=False, block_multiple_of=multiple,
        block_auto_adjust_ff_dim=bool(rng.random() < 0.7),
        block_ffn_dim_multiplier=float(rng.choice([1.0, 1.5])), pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=theta),
    )


def _granite(rng, config, needs_k_rows, eps, theta) -> dict:
    """Mamba2 layers (heads of 8 to 64 over 1 or 2 x the hidden width, 1 to 4 groups, state 16 to 64, conv
    kernel 2 to 4, conv and projection biases or not) beside NoPE attention (llama.cpp's converter marks a
    hybrid Granite NoPE whatever the config says), a shared SwiGLU MLP and the four multipliers. No experts,
    none a token (as the hub's dense Granite 4.0-H configs: llama.cpp refuses a file whose expert_used_count,
    HF's default 2, exceeds its expert_count)."""
    hidden = config["hidden_size"]
    num_heads, kv_heads, head_dim = _attention_heads(rng, hidden)
    inner = hidden * int(rng.choice([1, 2]))
    mamba_head = int(rng.choice([d for d in (8, 16, 32, 64) if inner % d == 0]))
    mamba_heads = inner // mamba_head
    as_f32 = lambda value: float(np.float32(value))  # noqa: E731 - GGUF keeps the multipliers as float32
    return dict(
        model_type="granitemoehybrid", rms_norm_eps=eps, num_attention_heads=num_heads,
        num_key_value_heads=kv_heads, attention_bias=bool(rng.random() < 0.3),
        layer_types=layer_kinds(rng, config["num_hidden_layers"], "mamba", "attention"),
        mamba_n_heads=mamba_heads, mamba_d_head=mamba_head, mamba_expand=inner // hidden,
        mamba_n_groups=int(rng.choice([g for g in (1, 2, 4) if mamba_heads % g == 0])),
        mamba_d_state=int(rng.choice([16, 32, 64])), mamba_d_conv=int(rng.integers(2, 5)),
        mamba_conv_bias=bool(rng.random() < 0.7), mamba_proj_bias=bool(rng.random() < 0.3),
        num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=_width(rng, needs_k_rows),
        position_embedding_type="nope",
        embedding_multiplier=as_f32(rng.choice([1.0, 3.0, 12.0])),
        residual_multiplier=as_f32(rng.choice([0.22, 0.6, 1.0])),
        attention_multiplier=as_f32(rng.choice([0.0078125, 0.09, head_dim**-0.5])),
        logits_scaling=as_f32(rng.choice([1.0, 1.6, 4.0])),
        rope_parameters=dict(rope_type="default", rope_theta=theta),
    )


_DRAWS = {"qwen3_5": _qwen3_5, "qwen3_next": _qwen3_next, "lfm2": _lfm2, "granitemoehybrid": _granite}
