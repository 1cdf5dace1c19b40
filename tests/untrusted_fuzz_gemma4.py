"""Gemma 4 mutations for the untrusted-input fuzzer (tests/untrusted_fuzz.py's group `gemma4`; issue 65), made from
its random text decoder's folder (a sliding layer, then a global one with proportional RoPE on a quarter of each
head, layer scalars, a final soft-cap: tests/untrusted_fuzz_bases.py; no GGUF: llama.cpp's converter writes none)
with the hybrid group's helpers (tests/untrusted_fuzz_hybrid.py): config.json's keys beyond the body that is built
(per-layer embeddings, KV sharing, experts, attention_k_eq_v, bidirectional attention, a global head size of its
own, per_layer_config, the double-wide MLP), the soft-cap, the window and layer kinds, each kind's RoPE and the
activation, set extreme, zero, negative, NaN, mistyped or inconsistent with the weights; the layer scalars and
the q/k norms shrunk, reshaped, dropped or non-finite. Written by the fuzzer's parent process, each under its
case's folder.
"""

from __future__ import annotations

import math
import random

import untrusted_fuzz_hf as hf
from untrusted_fuzz_hybrid import ODD, config_keys, entry, folder_drawn, shrunk, weights
from untrusted_mutation import Bases, Mutation

BASE = "gemma4_hf"
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER = "model.layers.0."
GEMMA4_KEYS = ("hidden_size_per_layer_input", "num_kv_shared_layers", "enable_moe_block", "attention_k_eq_v",
               "use_bidirectional_attention", "global_head_dim", "per_layer_config", "use_double_wide_mlp",
               "final_logit_softcapping", "sliding_window", "layer_types", "head_dim",
               "rope_parameters.full_attention.partial_rotary_factor", "rope_parameters.sliding_attention.rope_theta",
               "hidden_activation", "num_experts", "top_k_experts", "vocab_size_per_layer_input")


def _beyond_the_body() -> list[Mutation]:
    mutations = []
    for key, values in (("hidden_size_per_layer_input", (256, 1, -1, 0.0, "0", False, None)),
                        ("num_kv_shared_layers", (1, 2, -1, "0", None)),
                        ("enable_moe_block", (True, "false", 0, 1, None)), ("attention_k_eq_v", (True, 1, "no")),
                        ("use_bidirectional_attention", ("all", "vision", True, False, "none", 1)),
                        ("global_head_dim", (8, 32, 512, 0, -16, 16.0, "16", None)),
                        ("per_layer_config", ({"0": {"head_dim": 32}}, [{}], [], "x", None)),
                        ("use_double_wide_mlp", (True, "true", 1)), ("num_experts", (4, 0)), ("top_k_experts", (2,)),
                        ("moe_intermediate_size", (32,)), ("vocab_size_per_layer_input", (0, -1, 2**63)),
                        ("num_global_key_value_heads", (1, 4))):
        mutations += [config_keys(BASE, **{key: value}) for value in values]
    mutations.append(config_keys(BASE, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32))
    return mutations


def _attention() -> list[Mutation]:
    mutations = [config_keys(BASE, final_logit_softcapping=v) for v in (*ODD, -8.0, math.inf, 1e39, 1e-45)]
    mutations += [config_keys(BASE, attn_logit_softcapping=v) for v in (50.0, None)]
    mutations += [config_keys(BASE, sliding_window=v) for v in (0, -1, 1, 2**31, math.nan, "8", None)]
    mutations += [config_keys(BASE, layer_types=kinds) for kinds in (
        [FULL, FULL], [SLIDING, SLIDING], [FULL, SLIDING], [SLIDING], [SLIDING, FULL, FULL], [SLIDING, "chunked_attention"],
        [], SLIDING, None)]
    mutations += [config_keys(BASE, head_dim=v) for v in (0, 8, 32, -16, None)]
    mutations += [config_keys(BASE, head_dim=32, global_head_dim=32), config_keys(BASE, query_pre_attn_scalar=16)]
    mutations += [config_keys(BASE, **{key: v}) for key, v in (
        ("hidden_activation", "gelu"), ("hidden_activation", "silu"), ("hidden_activation", None),
        ("hidden_act", "relu"), ("attention_bias", True), ("rms_norm_eps", -1.0), ("rms_norm_eps", math.nan))]
    return mutations


def _rope() -> list[Mutation]:
    glob, local = "rope_parameters__full_attention__", "rope_parameters__sliding_attention__"
    mutations = []
    for key, values in ((glob + "partial_rotary_factor", (0.0, -0.25, 1.0, 1.5, 0.3, 0.01, math.nan, "0.25", None)),
                        (glob + "rope_type", ("default", "yarn", "linear", "llama3", "proportionate", None)),
                        (glob + "rope_theta", (0.0, -1.0, math.nan, math.inf, None)),
                        (glob + "factor", (2.0, 0.0, math.nan)),
                        (local + "rope_theta", (0.0, -1.0, math.nan, None)),
                        (local + "rope_type", ("proportional", "linear", None)),
                        (local + "partial_rotary_factor", (0.5,))):
        mutations += [config_keys(BASE, **{key: value}) for value in values]
    mutations += [config_keys(BASE, rope_parameters=v) for v in (
        {"rope_type": "default", "rope_theta": 10000.0}, {FULL: {"rope_type": "proportional", "rope_theta": 1e6}}, [],
        "proportional", None)]
    return mutations


def _tensors() -> list[Mutation]:
    scalar = LAYER + "layer_scalar"
    mutations = [shrunk(BASE, name, shape) for name, shape in (
        (scalar, []), (LAYER + "self_attn.q_norm.weight", [15]), (LAYER + "self_attn.k_norm.weight", [8]),
        (LAYER + "pre_feedforward_layernorm.weight", [63]))]
    mutations += [entry(BASE, scalar, field, value) for field, value in (
        ("shape", [1, 1]), ("shape", [2]), ("dtype", "I32"), ("dtype", "F16"), ("dtype", "BOOL"))]
    mutations += [weights(BASE, hf.renamed(name, new)) for name, new in (
        (scalar, None), (scalar, LAYER + "layer_scalar.weight"), (scalar, "model.layers.2.layer_scalar"),
        (LAYER + "pre_feedforward_layernorm.weight", None), (LAYER + "self_attn.k_norm.weight", LAYER + "self_attn.v_norm.weight"))]
    mutations += [weights(BASE, hf.nonfinite(name, index, value)) for name, index, value in (
        (scalar, 0, math.nan), (scalar, 0, math.inf), (scalar, 0, 0.0), (scalar, 0, -1e38),
        (LAYER + "self_attn.q_norm.weight", 1, math.nan))]
    return mutations


def catalog() -> list[Mutation]:
    return _beyond_the_body() + _attention() + _rope() + _tensors()


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A random Gemma 4 key of the folder's config.json (or any of its keys) given a random odd value, or a random
    field of a layer's safetensors entry given one."""
    return folder_drawn(rng, bases, BASE, rng.random(), GEMMA4_KEYS, ("layer_scalar", "self_attn.", "layernorm"))
