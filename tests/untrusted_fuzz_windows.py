"""Mutations of issue 65's sliding-window and NoPE families for the untrusted-input fuzzer (tests/untrusted_fuzz.py's
group `windows`), made from their random folders (tests/untrusted_fuzz_bases.py: OLMo 3, a sliding layer with its
own RoPE then a global one under YaRN; SmolLM3, four layers, the fourth NoPE; Exaone 4, a sliding layer then a NoPE
global one) with the hybrid group's helpers (tests/untrusted_fuzz_hybrid.py): config.json's layer_types,
sliding_window, Exaone 4's sliding_window_pattern, SmolLM3's no_rope_layers, no_rope_layer_interval and
use_sliding_window, the RoPE of each kind of layer (OLMo 3's rope_parameters by kind) and the q/k norms' sizes set
extreme, zero, negative, NaN, mistyped, short, long or inconsistent with the weights; the q/k norms' tensors
shrunk, dropped or non-finite. The GGUF files' mutations are tests/untrusted_fuzz_windows_gguf.py's. Written by
the fuzzer's parent process, each under its case's folder.
"""

from __future__ import annotations

import math
import random

import untrusted_fuzz_hf as hf
from untrusted_fuzz_hybrid import ODD, config_keys, folder_drawn, shrunk, weights
from untrusted_fuzz_hybrid_gguf import gguf_drawn
from untrusted_fuzz_windows_gguf import WINDOW_PARTS, windows_gguf_catalog
from untrusted_mutation import Bases, Mutation

SLIDING, FULL = "sliding_attention", "full_attention"
ATTENTION = "model.layers.0.self_attn."
# config keys a random case of each folder gives an odd value (dots: nested keys)
KEYS = {
    "olmo3_hf": ("layer_types", "sliding_window", "rope_parameters.sliding_attention.rope_theta",
                 "rope_parameters.sliding_attention.rope_type", "rope_parameters.full_attention.factor",
                 "rope_parameters.full_attention.original_max_position_embeddings", "rope_parameters.full_attention"),
    "smollm3_hf": ("no_rope_layers", "no_rope_layer_interval", "use_sliding_window", "sliding_window", "layer_types",
                   "rope_parameters.rope_theta"),
    "exaone4_hf": ("layer_types", "sliding_window", "sliding_window_pattern", "head_dim", "rope_parameters.rope_type"),
}
_KINDS = ([FULL, FULL], [SLIDING, SLIDING], [FULL, SLIDING], [SLIDING], [SLIDING, FULL, FULL], [SLIDING, "linear_attention"],
          [SLIDING, "chunked_attention"], [SLIDING, None], [], SLIDING, [0, 1], None)
_WINDOWS = (0, -1, 1, 2**31, 10**12, math.nan, 8.0, "8", True, None)


def _olmo3() -> list[Mutation]:
    base, local, glob = "olmo3_hf", "rope_parameters__sliding_attention__", "rope_parameters__full_attention__"
    mutations = [config_keys(base, layer_types=kinds) for kinds in _KINDS]
    mutations += [config_keys(base, sliding_window=v) for v in _WINDOWS]
    for key, values in ((local + "rope_theta", (0.0, -1.0, math.nan, math.inf, "1e4", None)),
                        (local + "rope_type", ("linear", "yarn", "llama3", "proportional", "", None)),
                        (local + "factor", (2.0, 0.0)),
                        (glob + "factor", (0.0, -8.0, math.nan, 1e39, None)), (glob + "rope_type", ("dynamic", "longrope", None)),
                        (glob + "original_max_position_embeddings", (0, -1, 2**40, None)),
                        (glob + "rope_theta", (0.0, math.nan, None))):
        mutations += [config_keys(base, **{key: value}) for value in values]
    mutations += [config_keys(base, rope_parameters=v) for v in (
        {"rope_type": "default", "rope_theta": 10000.0}, {"full_attention": {"rope_type": "default", "rope_theta": 1e4}},
        {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "default", [], None)]
    mutations += [config_keys(base, rope_parameters__chunked_attention={"rope_type": "default", "rope_theta": 1e4}),
                  config_keys(base, rope_theta=10000.0), config_keys(base, rope_local_base_freq=10000.0),
                  config_keys(base, rope_scaling={"rope_type": "linear", "factor": 2.0})]
    return mutations


def _smollm3() -> list[Mutation]:
    base = "smollm3_hf"  # 4 layers, no_rope_layers [1, 1, 1, 0], interval 4
    mutations = [config_keys(base, no_rope_layers=v) for v in (
        [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1], [1, 1, 1, 0, 1], [2, 1, 1, 0], [-1, 1, 1, 0], [True, True, True, False],
        [1.0, 1, 1, 0], ["1", "1", "1", "0"], [None, 1, 1, 0], [], "1110", 1, {"3": 0}, None)]
    mutations += [config_keys(base, no_rope_layers=None, no_rope_layer_interval=v) for v in (
        *ODD, 1, 2, 3, 5, 10**9)]
    mutations += [config_keys(base, no_rope_layer_interval=v) for v in (0, 2, math.nan)]  # beside the list, which wins
    for key, values in (("use_sliding_window", (True, "false", 1, None)), ("sliding_window", (8, 0, -1, math.nan)),
                        ("layer_types", ([SLIDING] * 4, [FULL] * 3, [FULL] * 5, None)),
                        ("rope_parameters__rope_type", ("yarn", "llama3", "linear", "proportional")),
                        ("rope_parameters__rope_theta", (0.0, -1.0, math.nan, None)), ("head_dim", (8, 32, 0))):
        mutations += [config_keys(base, **{key: value}) for value in values]
    mutations += [config_keys(base, use_sliding_window=True, sliding_window=8, layer_types=[SLIDING, FULL, FULL, FULL])]
    return mutations


def _exaone4() -> list[Mutation]:
    base = "exaone4_hf"  # head_dim 16 (hidden 64 / 4 heads), layer_types [sliding, full], pattern 4
    mutations = [config_keys(base, layer_types=kinds) for kinds in _KINDS]
    mutations += [config_keys(base, sliding_window=v) for v in _WINDOWS]
    mutations += [config_keys(base, layer_types=None, sliding_window_pattern=v) for v in (
        "LLLG", "LG", "GL", "L", "G", "", "LLGX", "lg", 0, -1, 1, 2, 3, 2**31, math.nan, 2.0, True, [1, 0], None)]
    mutations += [config_keys(base, layer_types=None, sliding_window=None, sliding_window_pattern=v) for v in ("LG", 2)]
    mutations += [config_keys(base, sliding_window_pattern=v) for v in ("GL", 0)]  # beside layer_types, which win
    for key, values in (("head_dim", (0, 8, 15, 32, -16, None)),
                        ("rope_parameters__rope_type", ("linear", "yarn", "llama3", "longrope", "proportional")),
                        ("rope_parameters__factor", (2.0, 0.0, math.nan)),
                        ("rope_parameters__rope_theta", (0.0, -1.0, math.nan, None))):
        mutations += [config_keys(base, **{key: value}) for value in values]
    llama3 = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    mutations += [config_keys(base, rope_parameters=v) for v in (
        llama3, {**llama3, "low_freq_factor": 4.0}, {SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                                                     FULL: {"rope_type": "default", "rope_theta": 1e6}}, None)]
    return mutations


def _tensors() -> list[Mutation]:
    mutations = [shrunk(base, ATTENTION + name, shape) for base, name, shape in (
        ("olmo3_hf", "q_norm.weight", [63]), ("olmo3_hf", "q_norm.weight", [16]), ("olmo3_hf", "k_norm.weight", [64]),
        ("exaone4_hf", "q_norm.weight", [15]), ("exaone4_hf", "k_norm.weight", [32]), ("exaone4_hf", "q_norm.weight", []),
        ("smollm3_hf", "q_proj.weight", [64, 63]), ("smollm3_hf", "k_proj.weight", [16, 64]))]
    renames = (("olmo3_hf", ATTENTION + "q_norm.weight", None), ("exaone4_hf", ATTENTION + "k_norm.weight", None),
               ("olmo3_hf", "model.layers.0.post_feedforward_layernorm.weight", None),
               ("exaone4_hf", "model.layers.0.post_attention_layernorm.weight", "model.layers.0.input_layernorm.weight"),
               ("smollm3_hf", "model.layers.3.self_attn.q_proj.weight", "model.layers.4.self_attn.q_proj.weight"))
    mutations += [weights(base, hf.renamed(name, new)) for base, name, new in renames]
    mutations += [weights(base, hf.nonfinite(ATTENTION + name, index, value)) for base, name, index, value in (
        ("olmo3_hf", "q_norm.weight", 0, math.nan), ("exaone4_hf", "k_norm.weight", 3, math.inf),
        ("smollm3_hf", "v_proj.weight", 5, -math.inf))]
    return mutations


def catalog() -> list[Mutation]:
    return _olmo3() + _smollm3() + _exaone4() + _tensors() + windows_gguf_catalog()


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A random window, NoPE or RoPE key of one of the folders' config.json (or any of its keys) given a random
    odd value, a random field of an attention safetensors entry given one, or a random mutation of a GGUF file's
    window, NoPE or RoPE parts."""
    choice = rng.random()
    if choice >= 0.55:
        return gguf_drawn(rng, bases, rng.choice(("olmo3_gguf", "smollm3_gguf", "exaone4_gguf")), WINDOW_PARTS)
    base = rng.choice(tuple(KEYS))
    return folder_drawn(rng, bases, base, choice, KEYS[base], ("self_attn.", "layernorm"))
