"""gpt-oss mutations for the untrusted-input fuzzer (tests/untrusted_fuzz.py's group `gpt_oss`; issue 65), made from
its random folder (a sliding layer then a full one, sinks, 4 experts in MXFP4 as the hub's folders hold them:
tests/untrusted_fuzz_bases.py) with the hybrid group's helpers (tests/untrusted_fuzz_hybrid.py): config.json's
swiglu_alpha / swiglu_limit, the experts' counts, the window and layer kinds, the head size, YaRN's keys and
quantization_config (its method, modules_to_not_convert, keys beyond them) set extreme, zero, negative, NaN,
mistyped or inconsistent with the weights; the sinks, the router, the experts' biases and their MXFP4 `_blocks`
and `_scales` shrunk, reshaped, renamed, dropped, given another dtype, a non-finite value or scale bytes past
the finite range (e8m0's 255 is NaN to the spec, 2^128 to ggml). The GGUF file's mutations are
tests/untrusted_fuzz_gpt_oss_gguf.py's. Written by the fuzzer's parent process, each under its case's folder.
"""

from __future__ import annotations

import math
import random

import untrusted_fuzz_hf as hf
from untrusted_fuzz_gpt_oss_gguf import GPT_OSS_PARTS, gpt_oss_gguf_catalog
from untrusted_fuzz_hybrid import ODD, config_keys, entry, folder_drawn, shrunk, weights
from untrusted_fuzz_hybrid_gguf import gguf_drawn
from untrusted_mutation import Bases, Mutation

BASE = "gpt_oss_hf"
LAYER = "model.layers.0."
EXPERTS = LAYER + "mlp.experts."
GPT_OSS_KEYS = ("swiglu_alpha", "swiglu_limit", "num_local_experts", "num_experts_per_tok", "sliding_window",
                "layer_types", "head_dim", "attention_bias", "rope_parameters.factor", "rope_parameters.beta_fast",
                "rope_parameters.beta_slow", "rope_parameters.truncate",
                "rope_parameters.original_max_position_embeddings", "quantization_config.quant_method",
                "quantization_config.modules_to_not_convert")
SLIDING, FULL = "sliding_attention", "full_attention"


def _clamp_and_experts() -> list[Mutation]:
    mutations = [config_keys(BASE, **{key: value}) for key in ("swiglu_alpha", "swiglu_limit") for value in (
        *ODD, -1.0, 1e39, 1e-45, math.inf, 0.5, 1000.0)]
    for key, values in (("num_local_experts", (1, 2, 3, 5, 8, 2**31, -1, "4", 4.0, None)),
                        ("num_experts_per_tok", (0, 1, 4, 5, -1, 2**31, "2", 2.0, None)),
                        ("experts_per_token", (2, 3)), ("num_experts", (4, 8)),
                        ("head_dim", (0, 8, 15, 32, -16, "16", None)), ("attention_bias", (False, "true", 1, None)),
                        ("router_aux_loss_coef", (math.nan, "x"))):
        mutations += [config_keys(BASE, **{key: value}) for value in values]
    return mutations


def _windows_and_rope() -> list[Mutation]:
    mutations = [config_keys(BASE, sliding_window=v) for v in (0, -1, 1, 2**31, 10**12, math.nan, 8.0, "8", True, None)]
    mutations += [config_keys(BASE, layer_types=kinds) for kinds in (
        [FULL, FULL], [SLIDING, SLIDING], [FULL, SLIDING], [SLIDING], [SLIDING, FULL, FULL], [SLIDING, "linear_attention"],
        [SLIDING, "chunked_attention"], [], SLIDING, [0, 1], None)]
    for key, values in (("factor", (0.0, -8.0, 1.0, 0.5, math.nan, math.inf, "8", None)),
                        ("beta_fast", (0.0, -32.0, 16.0, math.nan, "32", None)),
                        ("beta_slow", (0.0, 2.0, 64.0, math.nan, None)), ("truncate", (False, "yes", 1, None)),
                        ("original_max_position_embeddings", (0, -1, 1, 512, 2**40, math.nan, None)),
                        ("rope_type", ("default", "linear", "llama3", "longrope", "dynamic", "YARN", None)),
                        ("rope_theta", (0.0, -1.0, math.nan, math.inf, None)),
                        ("attention_factor", (0.0, -1.0, 2.0, math.nan)), ("mscale", (1.0,))):
        mutations += [config_keys(BASE, **{f"rope_parameters__{key}": value}) for value in values]
    mutations += [config_keys(BASE, rope_parameters=v) for v in (
        {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": {"rope_type": "default"}},
        "yarn", [], None)]
    return mutations


def _quantization() -> list[Mutation]:
    method = "quantization_config__quant_method"
    mutations = [config_keys(BASE, **{method: v}) for v in ("fp8", "MXFP4", "mxfp8", "", 4, None)]
    mutations += [config_keys(BASE, quantization_config__modules_to_not_convert=v) for v in (
        [], None, ["model.layers.*.mlp.experts"], ["model.layers.0.mlp.experts.gate_up_proj"], ["lm_head", "lm_head"],
        "lm_head", [1], [["lm_head"]], {"lm_head": True})]
    mutations += [config_keys(BASE, **{f"quantization_config__{key}": value}) for key, value in (
        ("bits", 4), ("dequantize", True), ("group_size", 32), ("activation_scheme", "dynamic"))]
    mutations += [config_keys(BASE, quantization_config=v) for v in ("mxfp4", [], {}, True, None)]
    return mutations


def byte_patched(name: str, index: int, value: int) -> Mutation:
    """Byte `index` of the uint8 tensor `name` (a scale's exponent, or two nibbles of a block) set to `value`."""
    def patches(header: dict) -> dict[int, bytes]:
        return {header[name]["data_offsets"][0] + index: bytes([value])}

    return weights(BASE, hf.header_mutation(f"{name} byte {index} = {value}", lambda header: header, patches=patches))


def _mxfp4_tensors() -> list[Mutation]:
    gate_up, down = EXPERTS + "gate_up_proj", EXPERTS + "down_proj"  # blocks [4, 64, 2 | 1, 16], scales [4, 64, 2 | 1]
    mutations = [entry(BASE, name, field, value) for name, field, value in (
        (gate_up + "_blocks", "shape", [4, 64, 4, 8]), (gate_up + "_blocks", "shape", [4, 128, 1, 16]),
        (gate_up + "_blocks", "shape", [4, 64, 2, 16, 1]), (gate_up + "_blocks", "shape", [8, 32, 2, 16]),
        (gate_up + "_blocks", "dtype", "I8"), (gate_up + "_blocks", "dtype", "F16"), (gate_up + "_blocks", "dtype", "BOOL"),
        (gate_up + "_scales", "shape", [4, 128]), (gate_up + "_scales", "shape", [4, 64, 2, 1]),
        (gate_up + "_scales", "shape", [2, 64, 4]), (gate_up + "_scales", "dtype", "I8"),
        (gate_up + "_scales", "dtype", "F8_E8M0"), (down + "_blocks", "shape", [4, 64, 16]),
        (down + "_scales", "shape", [4, 32, 2]), (down + "_scales", "dtype", "U16"))]
    mutations += [shrunk(BASE, name, shape) for name, shape in (
        (gate_up + "_bias", [4, 63]), (gate_up + "_bias", [3, 64]), (down + "_bias", [4, 32]),
        (LAYER + "mlp.router.weight", [3, 64]), (LAYER + "mlp.router.weight", [4, 63]), (LAYER + "mlp.router.bias", [3]),
        (LAYER + "self_attn.sinks", [3]), (LAYER + "self_attn.sinks", []))]
    mutations += [entry(BASE, LAYER + "self_attn.sinks", field, value) for field, value in (
        ("shape", [4, 1]), ("shape", [2, 2]), ("dtype", "I32"), ("dtype", "F16"), ("dtype", "U8"))]
    renames = ((gate_up + "_scales", None), (down + "_blocks", None), (gate_up + "_blocks", gate_up),
               (down + "_blocks", down + ".weight"), (gate_up + "_blocks", "model.layers.1.mlp.experts.gate_up_proj_blocks"),
               (LAYER + "self_attn.sinks", None), (LAYER + "self_attn.sinks", LAYER + "self_attn.sinks.weight"),
               (gate_up + "_bias", None), (LAYER + "mlp.router.bias", None))
    mutations += [weights(BASE, hf.renamed(name, new)) for name, new in renames]
    # scale bytes: 127 is 1; 252 the largest whose every value is finite; 253-254 overflow with a large nibble
    # (refused only where one meets it), 255 (2^128 in ggml, NaN to the OCP spec), 0 (2^-127)
    mutations += [byte_patched(name + "_scales", index, value) for name, index, value in (
        (down, 0, 255), (down, 5, 254), (down, 9, 253), (down, 3, 252), (gate_up, 0, 255), (gate_up, 7, 0),
        (gate_up, 100, 200))]
    mutations += [byte_patched(down + "_blocks", 16 * 5 + index, value) for index, value in ((0, 0x77), (1, 0xFF))]
    mutations += [weights(BASE, hf.nonfinite(name, index, value)) for name, index, value in (
        (LAYER + "self_attn.sinks", 0, math.nan), (LAYER + "self_attn.sinks", 1, math.inf),
        (LAYER + "self_attn.sinks", 2, -math.inf), (gate_up + "_bias", 3, math.nan), (down + "_bias", 0, math.inf),
        (LAYER + "mlp.router.bias", 1, math.nan))]
    return mutations


def catalog() -> list[Mutation]:
    return _clamp_and_experts() + _windows_and_rope() + _quantization() + _mxfp4_tensors() + gpt_oss_gguf_catalog()


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A random gpt-oss key of the folder's config.json (or any of its keys) given a random odd value, a random
    field of an attention or experts safetensors entry given one, or a random mutation of the GGUF file's
    gpt-oss parts."""
    choice = rng.random()
    if choice >= 0.55:
        return gguf_drawn(rng, bases, "gpt_oss_gguf", GPT_OSS_PARTS)
    return folder_drawn(rng, bases, BASE, choice, GPT_OSS_KEYS, ("sinks", "mlp."))
