"""Granite 4.0-H mutations for the untrusted-input fuzzer (tests/untrusted_fuzz.py's group `granite`), made from
its random folder (a Mamba2 layer, then NoPE attention: tests/untrusted_fuzz_bases.py) with the hybrid group's
helpers (tests/untrusted_fuzz_hybrid.py): config.json's mamba_* keys, layer_types and the hub's older
layers_block_type, the four multipliers, position_embedding_type, num_local_experts and the shared MLP's
width set extreme, zero, negative, NaN, infinite, mistyped or inconsistent with the weights; the Mamba2
tensors (in_proj, conv1d's weight and bias, A_log, D, dt_bias, the gated norm, out_proj) shrunk, reshaped,
renamed, dropped, given an integer dtype or a non-finite value. The GGUF file's mutations are
tests/untrusted_fuzz_granite_gguf.py's. Written by the fuzzer's parent process, each under its case's folder.
"""

from __future__ import annotations

import math
import random

from untrusted_fuzz_granite_gguf import GRANITE_PARTS, granite_gguf_catalog
from untrusted_fuzz_hf import nonfinite, renamed
from untrusted_fuzz_hybrid import ODD, config_keys, entry, folder_drawn, shrunk, weights
from untrusted_fuzz_hybrid_gguf import gguf_drawn
from untrusted_mutation import Bases, Mutation

BASE = "granite_hf"
MAMBA = "model.layers.0.mamba."
MAMBA_KEYS = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_expand")
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
GRANITE_KEYS = (*MAMBA_KEYS, "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit",
                "layer_types", "layers_block_type", *MULTIPLIERS, "position_embedding_type", "num_local_experts",
                "shared_intermediate_size")
INFINITY = {"__float__": "Infinity"}  # how transformers writes an infinity into config.json


def _mamba_config() -> list[Mutation]:
    mutations = [config_keys(BASE, **{key: value}) for key in MAMBA_KEYS for value in ODD]
    for key, values in (("mamba_n_heads", (2, 3, 8, 64)), ("mamba_d_head", (8, 32, "auto")),
                        ("mamba_d_state", (8, 32, 1024, 1025)), ("mamba_n_groups", (1, 3, 4, 8)),
                        ("mamba_d_conv", (1, 2, 3, 5, 64, 65)), ("mamba_expand", (2, 4)),
                        ("mamba_chunk_size", (0, -1, 1, 2**64 + 1, math.nan, "256", None)),
                        ("mamba_conv_bias", (False, "false", 0, 1, [True], None)),
                        ("mamba_proj_bias", (True, "true", 0, None)),
                        ("time_step_limit", ([0.0, 10.0], [0.001, INFINITY], [0.0], "inf",
                                             [0.0, {"__float__": "NaN"}], [-1.0, INFINITY], None))):
        mutations += [config_keys(BASE, **{key: value}) for value in values]
    # the same widths split another way: heads x head size, groups x state size, the expansion
    mutations += [config_keys(BASE, **pair) for pair in (
        dict(mamba_n_heads=8, mamba_d_head=8), dict(mamba_n_heads=2, mamba_d_head=32),
        dict(mamba_n_groups=4, mamba_d_state=8), dict(mamba_n_groups=1, mamba_d_state=32),
        dict(mamba_expand=2, mamba_d_head=32), dict(mamba_d_head="auto", mamba_n_heads=3),
        dict(mamba_d_head=None, mamba_expand=None, mamba_n_heads=None))]
    return mutations


def _layer_config() -> list[Mutation]:
    mamba, attention = "mamba", "attention"
    mutations = [config_keys(BASE, layer_types=kinds) for kinds in (
        [mamba, mamba], [attention, attention], [attention, mamba], [mamba], [mamba, attention, attention],
        ["linear_attention", "full_attention"], [mamba, "full_attention"], [mamba, "nope"], [mamba, "conv"],
        [mamba, "sliding_attention"], ["Mamba", attention], [1, 2], [], mamba, {}, [[mamba], [attention]], None)]
    # the hub's older key: read where layer_types is absent, and winning where both are given (as HF)
    mutations += [config_keys(BASE, layer_types=None, layers_block_type=kinds) for kinds in (
        [mamba, attention], [attention, mamba], [mamba], mamba, [0, 1], None)]
    mutations += [config_keys(BASE, layers_block_type=kinds) for kinds in ([attention, attention], [mamba, mamba])]
    return mutations


def _other_config() -> list[Mutation]:
    mutations = [config_keys(BASE, **{key: value}) for key in MULTIPLIERS for value in (
        0, -1.0, -0.0, math.nan, math.inf, -math.inf, 1e39, 1e-45, INFINITY, "0.6", "x", True, [0.6], None)]
    for key, values in (("position_embedding_type", ("rope", "alibi", "", "ROPE", 1, True, ["rope"], None)),
                        ("num_local_experts", (1, 8, -1, 0.0, False, "0", 2**64 + 1, [0], math.nan, None)),
                        ("shared_intermediate_size", (0, 95, 97, 128, 96.0, "96", None))):
        mutations += [config_keys(BASE, **{key: value}) for value in values]
    return mutations


def _tensors() -> list[Mutation]:
    mlp = "model.layers.0.shared_mlp."
    shapes = [(MAMBA + name, shape) for name, shape in (
        ("in_proj.weight", [195, 64]), ("in_proj.weight", [196, 63]), ("in_proj.weight", [192, 64]),
        ("conv1d.weight", [128, 1, 3]), ("conv1d.weight", [127, 1, 4]), ("conv1d.weight", [64, 1, 4]),
        ("conv1d.bias", [127]), ("A_log", [3]), ("A_log", [2]), ("A_log", []), ("D", [3]), ("D", [1]),
        ("dt_bias", [3]), ("norm.weight", [63]), ("norm.weight", [32]), ("out_proj.weight", [64, 63]),
        ("out_proj.weight", [63, 64]))]
    shapes += [(mlp + "input_linear.weight", [191, 64]), (mlp + "output_linear.weight", [64, 95])]
    mutations = [shrunk(BASE, name, shape) for name, shape in shapes]
    # the same bytes under another shape, or read as integers
    mutations += [entry(BASE, MAMBA + name, field, value) for name, field, value in (
        ("in_proj.weight", "shape", [64, 196]), ("in_proj.weight", "shape", [196, 64, 1]),
        ("conv1d.weight", "shape", [128, 4]), ("conv1d.weight", "shape", [128, 4, 1]),
        ("conv1d.weight", "shape", [4, 1, 128]), ("A_log", "shape", [4, 1]), ("A_log", "shape", [2, 2]),
        ("D", "shape", [1, 4]), ("dt_bias", "shape", [4, 1]), ("norm.weight", "shape", [2, 32]),
        ("in_proj.weight", "dtype", "F16"), ("A_log", "dtype", "I32"), ("A_log", "dtype", "I64"),
        ("D", "dtype", "I32"), ("D", "dtype", "BF16"), ("dt_bias", "dtype", "U32"), ("norm.weight", "dtype", "I32"),
        ("conv1d.bias", "dtype", "I32"), ("conv1d.weight", "dtype", "I32"), ("in_proj.weight", "dtype", "U32"),
        ("out_proj.weight", "dtype", "I32"))]
    renames = ((MAMBA + "in_proj.weight", MAMBA + "in_proj_qkvz.weight"),
               (MAMBA + "A_log", "model.layers.1.mamba.A_log"), (MAMBA + "A_log", MAMBA + "a_log"),
               (MAMBA + "D", None), (MAMBA + "dt_bias", None), (MAMBA + "conv1d.bias", None),
               (MAMBA + "norm.weight", None), (MAMBA + "norm.weight", MAMBA + "norm.bias"),
               (MAMBA + "out_proj.weight", "model.layers.0.self_attn.o_proj.weight"),
               (MAMBA + "conv1d.weight", "model.layers.0.linear_attn.conv1d.weight"),
               ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"))
    mutations += [weights(BASE, renamed(name, new)) for name, new in renames]
    values = (("A_log", 0, math.nan), ("A_log", 1, math.inf), ("A_log", 2, -math.inf), ("A_log", 3, 100.0),
              ("D", 0, math.nan), ("dt_bias", 1, math.inf), ("conv1d.weight", 5, math.nan),
              ("conv1d.bias", 0, -math.inf), ("norm.weight", 0, math.nan), ("in_proj.weight", 7, math.inf),
              ("out_proj.weight", 0, math.nan))
    mutations += [weights(BASE, nonfinite(MAMBA + name, index, value)) for name, index, value in values]
    return mutations


def catalog() -> list[Mutation]:
    return _mamba_config() + _layer_config() + _other_config() + _tensors() + granite_gguf_catalog()


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A random Granite key of the folder's config.json (or any of its keys) given a random odd value, a random
    field of a Mamba2 or shared-MLP safetensors entry given one, or a random mutation of the GGUF file's
    Granite parts."""
    choice = rng.random()
    if choice >= 0.55:
        return gguf_drawn(rng, bases, "granite_gguf", GRANITE_PARTS)
    return folder_drawn(rng, bases, BASE, choice, GRANITE_KEYS, (".mamba.", "shared_mlp"))
