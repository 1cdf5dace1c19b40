"""GGUF mutations of issue 65's sliding-window and NoPE families for the untrusted-input fuzzer
(tests/untrusted_fuzz_windows.py holds the group), made from the files llama.cpp's converter wrote
(tests/untrusted_fuzz_bases.py: `olmo2` with windows, OLMo 3's; `smollm3`; `exaone4`) with the hybrid group's
helpers (tests/untrusted_fuzz_hybrid_gguf.py): `attention.sliding_window`, `attention.sliding_window_pattern` (a bool
a layer, or every n-th layer global), the sliding layers' `rope.freq_base_swa`, the RoPE scaling's keys, SmolLM3's
`rope.dimension_count` and Exaone 4's head sizes given extreme, zero, mistyped, short or long values; the q/k norms'
tensor infos and values. Written by the fuzzer's parent process, each under its case's folder.
"""

from __future__ import annotations

import math

import untrusted_fuzz_gguf as gguf
from untrusted_fuzz_gguf_layout import ARRAY, BOOL, F32, I32, STRING, U8, U32, U64
from untrusted_fuzz_hybrid_gguf import added_entry, array, tensors, values
from untrusted_mutation import Mutation

# header numbers and tensors whose random edits are the group's (tests/untrusted_fuzz_hybrid_gguf.gguf_drawn)
WINDOW_PARTS = ("sliding_window", "rope", "key_length", "value_length", "head_count", "norm")
_ODD_TYPES = ((STRING, "8"), (F32, 8.0), (F32, math.nan), (I32, -8), (BOOL, True), (U64, 2**63), (None, None))


def _window_keys(base: str, arch: str) -> list[Mutation]:
    """The window and its pattern (the file's: [True, False]) of `base`."""
    window, pattern = f"{arch}.attention.sliding_window", f"{arch}.attention.sliding_window_pattern"
    mutations = [values(base, {window: (U32, v)}) for v in (0, 1, 2, 2**31, 2**32 - 1)]
    mutations += [values(base, {window: typed}) for typed in _ODD_TYPES]
    mutations += [array(base, pattern, BOOL, items) for items in (
        [False, False], [True, True], [False, True], [True], [True, False, True], [])]
    mutations += [array(base, pattern, item_type, items) for item_type, items in (
        (U32, [1, 0]), (U8, [2, 0]), (STRING, ["true", "false"]), (F32, [1.0, 0.0]), (I32, [-1, 0]))]
    mutations += [values(base, {pattern: typed}) for typed in (
        (U32, 0), (U32, 1), (U32, 2), (U32, 4), (U32, 2**32 - 1), (I32, -2), (BOOL, True), (STRING, "LG"), (F32, 2.0),
        (None, None))]
    mutations.append(values(base, {window: (None, None), pattern: (None, None)}))
    return mutations


def _olmo3() -> list[Mutation]:
    base, rope = "olmo3_gguf", "olmo2.rope"
    mutations = _window_keys(base, "olmo2")
    mutations += [values(base, {f"{rope}.freq_base_swa": typed}) for typed in (
        (F32, 0.0), (F32, -1.0), (F32, math.nan), (F32, math.inf), (F32, 1e-45), (U32, 10000), (STRING, "1e4"),
        (None, None))]
    mutations += [values(base, {f"{rope}.scaling.type": (STRING, kind)}) for kind in ("none", "linear", "longrope", "")]
    mutations += [values(base, {key: typed}) for key, typed in (
        (f"{rope}.scaling.factor", (F32, 0.0)), (f"{rope}.scaling.factor", (F32, math.nan)),
        (f"{rope}.scaling.factor", (None, None)), (f"{rope}.scaling.original_context_length", (U32, 0)),
        (f"{rope}.scaling.original_context_length", (U32, 2**32 - 1)),
        (f"{rope}.scaling.original_context_length", (None, None)))]
    mutations += [added_entry(base, f"olmo2.{key}", *typed) for key, typed in (
        ("rope.dimension_count", (U32, 8)), ("attention.key_length", (U32, 8)), ("rope.scaling.yarn_beta_fast", (F32, 8.0)),
        ("attention.clamp_kqv", (F32, 8.0)))]
    return mutations


def _smollm3() -> list[Mutation]:
    base, arch = "smollm3_gguf", "smollm3"
    mutations = [values(base, {f"{arch}.rope.dimension_count": (U32, v)}) for v in (0, 8, 15, 32, 2**31)]
    mutations += [values(base, {f"{arch}.rope.dimension_count": typed}) for typed in _ODD_TYPES]
    mutations += [added_entry(base, f"{arch}.{key}", *typed) for key, typed in (
        ("attention.sliding_window", (U32, 8)), ("attention.sliding_window_pattern", (U32, 2)),
        ("attention.key_length", (U32, 8)), ("attention.key_length", (U32, 16)), ("attention.value_length", (U32, 32)),
        ("rope.scaling.type", (STRING, "yarn")), ("rope.scaling.type", (STRING, "linear")),
        ("rope.freq_base_swa", (F32, 10000.0)), ("no_rope_layer_step", (U32, 2)))]
    mutations += [values(base, {f"{arch}.block_count": (U32, v)}) for v in (3, 5, 8)]
    return mutations


def _exaone4() -> list[Mutation]:
    base, arch = "exaone4_gguf", "exaone4"
    mutations = _window_keys(base, arch)
    mutations += [values(base, {f"{arch}.attention.{key}": (U32, v)}) for key, vs in (
        ("key_length", (0, 8, 15, 32, 2**31)), ("value_length", (0, 8, 32))) for v in vs]
    mutations += [values(base, {f"{arch}.attention.key_length": typed}) for typed in _ODD_TYPES]
    mutations += [added_entry(base, f"{arch}.{key}", *typed) for key, typed in (
        ("rope.freq_base_swa", (F32, 10000.0)), ("rope.freq_base_swa", (F32, 1e6)), ("rope.scaling.type", (STRING, "yarn")),
        ("rope.scaling.type", (STRING, "linear")), ("rope.scaling.factor", (F32, 4.0)),
        ("attention.sliding_window_pattern_size", (U32, 4)))]
    mutations.append(added_entry(base, "exaone4.rope.dimension_count", ARRAY, [16, 16], U32))
    return mutations


def _tensors() -> list[Mutation]:
    dims = (("olmo3_gguf", "blk.0.attn_q_norm.weight", (63,)), ("olmo3_gguf", "blk.0.attn_q_norm.weight", (16,)),
            ("olmo3_gguf", "blk.0.attn_k_norm.weight", (64,)), ("olmo3_gguf", "blk.0.attn_q_norm.weight", (1, 64)),
            ("exaone4_gguf", "blk.0.attn_q_norm.weight", (15,)), ("exaone4_gguf", "blk.0.attn_k_norm.weight", (32,)),
            ("exaone4_gguf", "blk.0.attn_q_norm.weight", (4, 16)), ("smollm3_gguf", "blk.3.attn_q.weight", (64, 63)),
            ("smollm3_gguf", "blk.3.attn_k.weight", (64, 16)))
    mutations = [tensors(base, gguf.reshaped(name, shape)) for base, name, shape in dims]
    mutations += [tensors(base, gguf.reshaped(name, ggml_type=t)) for base, name, t in (
        ("olmo3_gguf", "blk.0.attn_q_norm.weight", 8), ("exaone4_gguf", "blk.0.attn_k_norm.weight", 1),
        ("smollm3_gguf", "blk.0.attn_q.weight", 39))]
    for base, name in (("olmo3_gguf", "blk.0.attn_k_norm.weight"), ("exaone4_gguf", "blk.1.post_ffw_norm.weight"),
                       ("smollm3_gguf", "blk.3.ffn_norm.weight")):
        mutations.append(tensors(base, gguf.edit_tensors(f"tensor {name} dropped", lambda infos, name=name: [
            gguf.encode_tensor(t) for t in infos if t.name != name])))
    mutations += [tensors(base, gguf.renamed(name, new)) for base, name, new in (
        ("olmo3_gguf", "blk.0.post_ffw_norm.weight", "blk.0.ffn_norm.weight"),
        ("exaone4_gguf", "blk.0.attn_q_norm.weight", "blk.1.attn_q_norm.weight"))]
    mutations += [tensors(base, gguf.patched_weight(name, 0, math.nan)) for base, name in (
        ("olmo3_gguf", "blk.1.attn_q_norm.weight"), ("exaone4_gguf", "blk.0.attn_k_norm.weight"))]
    return mutations


def windows_gguf_catalog() -> list[Mutation]:
    return _olmo3() + _smollm3() + _exaone4() + _tensors()
