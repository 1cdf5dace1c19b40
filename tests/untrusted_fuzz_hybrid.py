"""Hybrid-model mutations for the untrusted-input fuzzer (tests/untrusted_fuzz.py; issue 64), made from the
Qwen3-Next and LFM2 bases (tests/untrusted_fuzz_bases.py): their config.json's recurrent keys (the linear_*
sizes, layer_types, full_attention_interval, shared_expert_intermediate_size, conv_L_cache, LFM2's block_*
keys) set extreme, zero, negative, NaN, mistyped or inconsistent with the weights, and their safetensors
entries of the Gated DeltaNet, the short conv and the shared expert reshaped, shrunk, renamed or made
non-finite; the GGUF files' mutations are tests/untrusted_fuzz_hybrid_gguf.py's. The folder and GGUF helpers
of tests/untrusted_fuzz_{hf,gguf}.py are reused on a hybrid base (`on_base`); Granite 4.0-H's mutations, a
group of their own, reuse these (tests/untrusted_fuzz_granite.py). `catalog()` is the named list; `drawn` a
random one from a seeded generator. Written by the fuzzer's parent process, each under its case's folder.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import untrusted_fuzz_hf as hf
from untrusted_fuzz_hybrid_gguf import gguf_catalog, gguf_drawn
from untrusted_mutation import ODD_JSON_VALUES, Bases, Mutation, kind_of, on_base, safetensors_parts

FOLDER_LABELS = {"next_hf": "Qwen3-Next folder", "lfm2_hf": "LFM2 folder", "granite_hf": "Granite 4.0-H folder",
                 "gpt_oss_hf": "gpt-oss folder", "olmo3_hf": "OLMo 3 folder", "smollm3_hf": "SmolLM3 folder",
                 "exaone4_hf": "Exaone 4 folder", "gemma4_hf": "Gemma 4 folder"}
# the bases this group's random cases come from (Granite's: tests/untrusted_fuzz_granite.py, its own group)
DRAWN_FOLDERS, DRAWN_GGUFS = ("lfm2_hf", "next_hf"), ("lfm2_gguf", "next_gguf")
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim", "shared_expert_intermediate_size")
NEXT_KEYS = (*LINEAR_KEYS, "layer_types", "full_attention_interval", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "rope_parameters.partial_rotary_factor")
LFM2_KEYS = ("conv_L_cache", "layer_types", "full_attn_idxs", "block_multiple_of", "block_ffn_dim_multiplier",
             "block_auto_adjust_ff_dim", "conv_bias", "norm_eps", "intermediate_size", "num_key_value_heads")
ODD = (0, -1, 2**31, 2**64 + 1, math.nan, 2.5, "16", [16], True, None)  # None: the key dropped
LINEAR = "model.layers.0.linear_attn."
CONV = "model.layers.0.conv."
LINEAR_TENSORS = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight",
                  "out_proj.weight")


def config_keys(base: str, **values: object) -> Mutation:
    """The base folder's config.json keys (`__` for a dot) set; None drops one."""
    return on_base(hf.set_keys(**values), base, kind_of(base, "config"), FOLDER_LABELS[base])


def without_layer_types(base: str, **values: object) -> Mutation:
    """layer_types dropped, so that the kinds come from full_attention_interval or full_attn_idxs."""
    return config_keys(base, layer_types=None, **values)


def weights(base: str, mutation: Mutation) -> Mutation:
    """A model.safetensors mutation (tests/untrusted_fuzz_hf.py's) made from the hybrid folder `base`."""
    return on_base(mutation, base, kind_of(base, "safetensors"), FOLDER_LABELS[base])


def entry(base: str, name: str, field: str, value: object) -> Mutation:
    return weights(base, hf.entry_mutation(name, field, value))


def shrunk(base: str, name: str, shape: list[int]) -> Mutation:
    """Tensor `name` given a smaller shape and data_offsets that agree with it (the rest of its bytes unread),
    so that the file is a valid safetensors file and only the model's shape checks can refuse it."""

    def edit(header: dict) -> dict:
        start = header[name]["data_offsets"][0]
        header[name] = {**header[name], "shape": shape, "data_offsets": [start, start + 4 * math.prod(shape)]}
        return header

    return weights(base, hf.header_mutation(f"{name} shape {shape}, data_offsets to match", edit))


def _next_config() -> list[Mutation]:
    base = "next_hf"
    mutations = [config_keys(base, **{key: value}) for key in LINEAR_KEYS for value in ODD]
    for key, values in (("linear_num_key_heads", (1, 4, 3)), ("linear_num_value_heads", (2, 3, 8)),
                        ("linear_key_head_dim", (8, 32)), ("linear_value_head_dim", (8, 32)),
                        ("linear_conv_kernel_dim", (1, 3, 64, 65)), ("shared_expert_intermediate_size", (47, 96)),
                        ("num_experts", (0, 4, 9, 2**31)), ("num_experts_per_tok", (0, 9, 2**31)),
                        ("moe_intermediate_size", (0, 33)), ("mlp_only_layers", ([0], [5], "0")),
                        ("decoder_sparse_step", (0, 2, -1)), ("head_dim", (16, 0))):
        mutations += [config_keys(base, **{key: value}) for value in values]
    linear, full = "linear_attention", "full_attention"
    for kinds in ([full, full], [linear, linear], [linear], [linear, full, full], [full, linear], [linear, "nope"],
                  [linear, "conv"], [linear, "sliding_attention"], [1, 2], [], linear, {}, [[linear], [full]]):
        mutations.append(config_keys(base, layer_types=kinds))
    mutations += [without_layer_types(base, full_attention_interval=v)
                  for v in (0, -1, 1, 2, 3, 10**9, 2**64 + 1, math.nan, 2.0, "2", True, [2], None)]
    mutations += [config_keys(base, rope_parameters__partial_rotary_factor=v)
                  for v in (0.0, -0.25, 2.0, 0.3, math.nan, "0.25", None)]
    return mutations


def _lfm2_config() -> list[Mutation]:
    base, conv, full = "lfm2_hf", "conv", "full_attention"
    mutations = [config_keys(base, conv_L_cache=v) for v in (0, 1, 2, 4, 64, 65, -1, 2**31, 2**64 + 1, math.nan,
                                                              "3", 3.0, True, [3], None)]
    mutations += [config_keys(base, layer_types=kinds) for kinds in (
        [conv, conv], [full, full], [full, conv], [conv], [conv, full, full], [conv, "nope"],
        [conv, "linear_attention"], [0, 1], conv)]
    mutations += [without_layer_types(base, full_attn_idxs=v) for v in ([1], [0], [5], [-1], [1, 1], "1", [1.0],
                                                                         [True], [], 1, None)]
    for key, values in (("block_multiple_of", (0, -1, 2**31, math.nan, "32", None)),
                        ("block_ffn_dim_multiplier", (0.0, -1.0, 1e9, math.nan, "1", 2.0, None)),
                        ("block_auto_adjust_ff_dim", (False, "yes", None)), ("conv_bias", (True, "no", [])),
                        ("norm_eps", (math.nan, -1.0, "1e-5", None)), ("intermediate_size", (1, 0, 2**31)),
                        ("num_key_value_heads", (0, 3, 2**31))):
        mutations += [config_keys(base, **{key: value}) for value in values]
    return mutations


def _next_tensors() -> list[Mutation]:
    base, a_log, mlp = "next_hf", LINEAR + "A_log", "model.layers.0.mlp."
    shapes = [(LINEAR + name, shape) for name, shape in (
        ("in_proj_qkvz.weight", [176, 64]), ("in_proj_qkvz.weight", [192, 63]), ("in_proj_ba.weight", [4, 64]),
        ("in_proj_ba.weight", [6, 64]), ("conv1d.weight", [128, 1, 3]), ("conv1d.weight", [127, 1, 4]),
        ("conv1d.weight", [64, 1, 4]), ("A_log", [3]), ("A_log", [2]), ("A_log", []), ("dt_bias", [3]),
        ("norm.weight", [15]), ("norm.weight", [8]), ("out_proj.weight", [64, 63]))]
    shapes += [(mlp + "shared_expert.up_proj.weight", [47, 64]), (mlp + "shared_expert_gate.weight", [1, 63]),
               (mlp + "experts.0.gate_proj.weight", [31, 64])]
    mutations = [shrunk(base, name, shape) for name, shape in shapes]
    fields = [(LINEAR + name, field, value) for name, field, value in (
        ("in_proj_qkvz.weight", "shape", [64, 192]), ("in_proj_qkvz.weight", "shape", [192, 64, 1]),
        ("in_proj_qkvz.weight", "dtype", "F16"), ("conv1d.weight", "shape", [128, 4]),
        ("conv1d.weight", "shape", [128, 4, 1]), ("conv1d.weight", "shape", [256, 1, 2]), ("A_log", "shape", [2, 2]),
        ("A_log", "shape", [4, 1]), ("A_log", "dtype", "I32"), ("dt_bias", "dtype", "BF16"),
        ("in_proj_ba.weight", "shape", [64, 8]))]
    mutations += [entry(base, *edit) for edit in [*fields, (mlp + "shared_expert_gate.weight", "shape", [64])]]
    renames = ((LINEAR + "in_proj_qkvz.weight", LINEAR + "in_proj_qkv.weight"),
               (a_log, "model.layers.1.linear_attn.A_log"), (LINEAR + "in_proj_ba.weight", LINEAR + "in_proj_b.weight"),
               (a_log, None), (LINEAR + "conv1d.weight", None), (mlp + "shared_expert_gate.weight", None),
               (mlp + "experts.7.up_proj.weight", mlp + "experts.8.up_proj.weight"))
    mutations += [weights(base, hf.renamed(name, new)) for name, new in renames]
    values = (("A_log", 0, math.nan), ("A_log", 1, math.inf), ("A_log", 2, 100.0), ("A_log", 3, -math.inf),
              ("dt_bias", 0, math.nan), ("conv1d.weight", 5, math.inf), ("norm.weight", 0, math.nan))
    mutations += [weights(base, hf.nonfinite(LINEAR + name, index, value)) for name, index, value in values]
    return mutations


def _lfm2_tensors() -> list[Mutation]:
    base, weight = "lfm2_hf", CONV + "conv.weight"
    mutations = [shrunk(base, CONV + name, shape) for name, shape in (
        ("conv.weight", [64, 1, 2]), ("conv.weight", [63, 1, 3]), ("in_proj.weight", [191, 64]),
        ("in_proj.weight", [128, 64]), ("out_proj.weight", [64, 63]))]
    mutations += [entry(base, weight, field, value) for field, value in (
        ("shape", [64, 3]), ("shape", [64, 3, 1]), ("shape", [32, 1, 6]), ("dtype", "F16"))]
    mutations += [weights(base, hf.renamed(weight, None)),
                  weights(base, hf.renamed(CONV + "in_proj.weight", "model.layers.1.conv.in_proj.weight")),
                  weights(base, hf.nonfinite(weight, 7, math.nan))]
    return mutations


def catalog() -> list[Mutation]:
    return _next_config() + _lfm2_config() + _next_tensors() + _lfm2_tensors() + gguf_catalog()


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A random hybrid key of a folder's config.json (or any of its keys) given a random odd value, a random
    field of a recurrent layer's safetensors entry given one, or a GGUF file's mutation (`gguf_drawn`)."""
    choice = rng.random()
    if choice >= 0.55:
        return gguf_drawn(rng, bases, rng.choice(DRAWN_GGUFS))
    base = rng.choice(DRAWN_FOLDERS)
    keys = NEXT_KEYS if base == "next_hf" else LFM2_KEYS
    return folder_drawn(rng, bases, base, choice, keys, (".linear_attn.", ".conv.", "shared_expert"))


def folder_drawn(rng: random.Random, bases: Bases, base: str, choice: float, keys: tuple[str, ...],
                 parts: tuple[str, ...]) -> Mutation:
    """The folder `base`'s config key (one of `keys`, or any of its keys) given a random odd value where
    `choice` < 0.35, else a random field of a safetensors entry whose name holds one of `parts`."""
    value = rng.choice(ODD_JSON_VALUES)
    folder = replace(bases, hf=getattr(bases, base))
    if choice < 0.35:
        config = json.loads((Path(folder.hf) / "config.json").read_text())
        key = rng.choice([*keys, *config])
        return config_keys(base, **{key.replace(".", "__"): value})
    header, _ = safetensors_parts(str(Path(folder.hf) / hf.WEIGHTS))
    name = rng.choice(sorted(n for n in header if any(part in n for part in parts)))
    field = rng.choice(("dtype", "shape", "data_offsets"))
    if field != "dtype" and rng.random() < 0.5:  # one number of the list
        items = header[name][field]
        index = rng.randrange(len(items)) if items else 0
        value = [value if i == index else v for i, v in enumerate(items)] or [value]
    return entry(base, name, field, value)
