"""Issue 65's attention families in the GGUF differential fuzzer (tests/gguf_fuzz.py): random Hugging Face configs
of OLMo 2, OLMo 3, SmolLM3, Exaone 4 and gpt-oss, whose GGUF files llama.cpp's own converter writes
(tests/gguf_fuzz_convert.py), with the GPT-2 tokenizer as the hybrids' (tests/gguf_fuzz_hybrid.py).

Drawn from the seed, within what a GGUF file can say (what llama.cpp fixes in its code is drawn as it fixes it):
head counts and sizes, GQA ratios, MLP and hidden widths that are and are not multiples of 256, tied or untied
outputs; OLMo 3's and Exaone 4's layer kinds in any order and their window (OLMo 3's sliding layers their own
default RoPE base, unscaled); Exaone 4 with or without windows (its global layers NoPE where it has them); SmolLM3
with 2 to 5 layers (every fourth NoPE, llama.cpp's rule and HF's default); gpt-oss's heads of their own size,
4 or 8 experts (1 to 3 a token), sliding and full layers alternating (llama.cpp's pattern 2), the clamp at
llama.cpp's limit 7 crossed (its experts' gate_up drawn wide: `init_scale`), YaRN truncated (llama.cpp floors
and ceils its range) or no scaling. RoPE default, linear or YaRN where the family reads it from a file.
"""

from __future__ import annotations

import numpy as np
from gguf_fuzz_hybrid import GPT2_EOS, VOCABS

ATTENTION_FAMILIES = ("olmo2", "olmo3", "smollm3", "exaone4", "gpt_oss")
_HIDDEN = (96, 160, 224, 256, 320, 512)
_GATE_UP_STD = 4.0  # gpt-oss's experts' gate and up values before the clamp: about 8% of them past 7


def draw_attention_config(rng: np.random.Generator, family: str, needs_k_rows: bool) -> dict:
    """A Hugging Face config of `family` (model_type included); `needs_k_rows`: the MLP's (the experts') width a
    multiple of 256, so that K-quant types fit the down projections whatever the hidden width."""
    vocab = int(rng.choice(VOCABS))
    config = dict(
        hidden_size=int(rng.choice(_HIDDEN)), num_hidden_layers=2, vocab_size=vocab, bos_token_id=GPT2_EOS,
        eos_token_id=GPT2_EOS, pad_token_id=0, max_position_embeddings=256, hidden_act="silu",
        tie_word_embeddings=bool(rng.random() < 0.5),
        intermediate_size=int(rng.choice((256, 512, 768) if needs_k_rows else (64, 96, 128, 192, 256, 352, 512))),
        rms_norm_eps=float(np.float32(rng.choice([1e-5, 1e-6]))),  # GGUF keeps it as a float32
        rope_parameters=_rope(rng, float(rng.choice([10000.0, 500000.0]))),
    )
    config.update(_DRAWS[family](rng, config, needs_k_rows))
    return config


def init_scale(config: dict, name: str) -> float:
    """The factor on the fuzzer's init of HF parameter `name`: gpt-oss's experts' gate_up wide enough that the
    clamp is crossed (HF's [experts, hidden, 2 x width], drawn with a standard deviation of (2 x width)^-0.5)."""
    if config["model_type"] != "gpt_oss" or not name.endswith("experts.gate_up_proj"):
        return 1.0
    return _GATE_UP_STD * (2 * config["intermediate_size"] / config["hidden_size"]) ** 0.5


def _rope(rng: np.random.Generator, theta: float) -> dict:
    """Default, linear or YaRN (YaRN's factor is the context's over its original, as HF wants)."""
    kind = str(rng.choice(["default", "linear", "yarn"]))
    if kind == "linear":
        return dict(rope_type="linear", rope_theta=theta, factor=float(rng.choice([2.0, 4.0])))
    if kind == "yarn":
        original = int(rng.choice([32, 64]))
        return dict(rope_type="yarn", rope_theta=theta, factor=256 / original, original_max_position_embeddings=original)
    return dict(rope_type="default", rope_theta=theta)


def _shared_heads(rng: np.random.Generator, hidden: int) -> tuple[int, int]:
    """(heads, KV heads) with heads x head size = hidden (OLMo's and llama's layout: no head_dim key)."""
    head_dim = int(rng.choice([d for d in (16, 32, 64) if hidden % d == 0 and hidden // d <= 16]))
    num_heads = hidden // head_dim
    return num_heads, int(rng.choice([k for k in range(1, num_heads + 1) if num_heads % k == 0]))


def _own_heads(rng: np.random.Generator) -> dict:
    """Heads of a size of their own (any count, any hidden width)."""
    num_heads = int(rng.integers(1, 9))
    return dict(head_dim=int(rng.choice([16, 32, 64])), num_attention_heads=num_heads,
                num_key_value_heads=int(rng.choice([k for k in range(1, num_heads + 1) if num_heads % k == 0])))


def _kinds(rng: np.random.Generator, num_layers: int) -> list[str]:
    return [str(rng.choice(["sliding_attention", "full_attention"])) for _ in range(num_layers)]


def _olmo2(rng, config, needs_k_rows) -> dict:
    num_heads, kv_heads = _shared_heads(rng, config["hidden_size"])
    return dict(model_type="olmo2", num_attention_heads=num_heads, num_key_value_heads=kv_heads)


def _olmo3(rng, config, needs_k_rows) -> dict:
    """Layer kinds in any order, 2 to 4 layers; the sliding layers' own base, unscaled (llama.cpp's rule)."""
    keys = _olmo2(rng, config, needs_k_rows)
    num_layers = int(rng.integers(2, 5))
    local = dict(rope_type="default", rope_theta=float(rng.choice([10000.0, 500000.0])))
    keys.update(model_type="olmo3", num_hidden_layers=num_layers, sliding_window=int(rng.choice([8, 16, 24])),
                layer_types=_kinds(rng, num_layers),
                rope_parameters={"sliding_attention": local, "full_attention": config["rope_parameters"]})
    return keys


def _smollm3(rng, config, needs_k_rows) -> dict:
    """2 to 5 layers: every fourth without RoPE, as llama.cpp fixes it and HF's no_rope_layers default is."""
    num_heads, kv_heads = _shared_heads(rng, config["hidden_size"])
    return dict(model_type="smollm3", num_hidden_layers=int(rng.choice([2, 4, 5])), num_attention_heads=num_heads,
                num_key_value_heads=kv_heads)


def _exaone4(rng, config, needs_k_rows) -> dict:
    """Windows (kinds in any order, the global layers NoPE) or none (every layer global, with RoPE)."""
    num_layers = int(rng.integers(2, 5))
    keys = dict(model_type="exaone4", num_hidden_layers=num_layers, **_own_heads(rng))
    if rng.random() < 0.2:
        return keys | dict(sliding_window=None, layer_types=["full_attention"] * num_layers)
    return keys | dict(sliding_window=int(rng.choice([8, 16, 24])), layer_types=_kinds(rng, num_layers))


def _gpt_oss(rng, config, needs_k_rows) -> dict:
    """Sliding and full layers alternating from a sliding one, sinks, q/k/v/o biases, 4 or 8 experts with biases,
    the clamp at 7; YaRN (HF's betas, truncated) or none."""
    num_layers = int(rng.integers(2, 5))
    rope = dict(config["rope_parameters"])
    if rope["rope_type"] == "linear":  # gpt-oss is YaRN or nothing
        rope = dict(rope_type="default", rope_theta=rope["rope_theta"])
    if rope["rope_type"] == "yarn":
        rope.update(beta_fast=32.0, beta_slow=1.0, truncate=True)
    num_experts = int(rng.choice([4, 8]))
    return dict(
        model_type="gpt_oss", num_hidden_layers=num_layers, num_local_experts=num_experts,
        num_experts_per_tok=int(rng.integers(1, 4)), intermediate_size=int(rng.choice(
            (256, 512) if needs_k_rows else (32, 64, 96, 128, 256))),
        sliding_window=int(rng.choice([8, 16, 24])), attention_bias=True, swiglu_limit=7.0,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        rope_parameters=rope, **_own_heads(rng),
    )


_DRAWS = {"olmo2": _olmo2, "olmo3": _olmo3, "smollm3": _smollm3, "exaone4": _exaone4, "gpt_oss": _gpt_oss}
