"""gpt-oss GGUF mutations for the untrusted-input fuzzer (tests/untrusted_fuzz_gpt_oss.py holds the group), made
from the `gpt-oss` file llama.cpp's converter wrote of the MXFP4 folder (tests/untrusted_fuzz_bases.py: its experts
kept in MXFP4, ggml type 39) with the hybrid group's helpers (tests/untrusted_fuzz_hybrid_gguf.py): the experts'
counts and width, the window and its pattern, the sliding layers' own RoPE base, YaRN's keys and the head sizes
given extreme, zero, mistyped, short or long values; the sinks', the experts' and their biases' tensor infos
(dims, types, names) and values (an MXFP4 block's scale byte past the finite range, NaN sinks). Written by the
fuzzer's parent process, each under its case's folder.
"""

from __future__ import annotations

import math

import untrusted_fuzz_gguf as gguf
from untrusted_fuzz_gguf_layout import ARRAY, BOOL, F32, I32, STRING, U32, U64
from untrusted_fuzz_hybrid_gguf import added_entry, tensors, values
from untrusted_mutation import Mutation

BASE, ARCH = "gpt_oss_gguf", "gpt-oss"
# header numbers and tensors whose random edits are the group's (tests/untrusted_fuzz_hybrid_gguf.gguf_drawn)
GPT_OSS_PARTS = ("expert", "exps", "sinks", "sliding_window", "rope", "key_length", "value_length", "head_count")
_ODD_TYPES = ((STRING, "4"), (F32, 4.0), (F32, math.nan), (I32, -4), (BOOL, True), (U64, 2**63), (ARRAY, ["4"]),
              (None, None))


def _metadata() -> list[Mutation]:
    numbers = [(f"{ARCH}.expert_count", (0, 1, 3, 5, 8, 2**32 - 1)), (f"{ARCH}.expert_used_count", (0, 1, 5, 2**32 - 1)),
               (f"{ARCH}.expert_feed_forward_length", (0, 16, 31, 33, 64, 2**31)),
               (f"{ARCH}.feed_forward_length", (0, 64)), (f"{ARCH}.attention.sliding_window", (0, 1, 2**32 - 1)),
               (f"{ARCH}.attention.key_length", (0, 8, 15, 32, 2**31)), (f"{ARCH}.attention.value_length", (0, 8, 32)),
               (f"{ARCH}.rope.scaling.original_context_length", (0, 1, 512, 2**32 - 1)),
               (f"{ARCH}.block_count", (1, 3))]
    mutations = [values(BASE, {key: (U32, v)}) for key, vs in numbers for v in vs]
    for key in (f"{ARCH}.expert_count", f"{ARCH}.expert_used_count", f"{ARCH}.attention.sliding_window"):
        mutations += [values(BASE, {key: typed}) for typed in _ODD_TYPES]
    pattern = f"{ARCH}.attention.sliding_window_pattern"  # absent in the converter's file: llama.cpp's 2
    mutations += [added_entry(BASE, pattern, ARRAY, items, BOOL) for items in (
        [True, False], [False, True], [True, True], [False, False], [True], [True, False, True], [])]
    mutations += [added_entry(BASE, pattern, *typed) for typed in ((U32, 2), (U32, 1), (U32, 0), (U32, 3), (I32, -2),
                                                                   (STRING, "LG"), (F32, 2.0))]
    rope = f"{ARCH}.rope"
    mutations += [added_entry(BASE, f"{rope}.freq_base_swa", *typed) for typed in (
        (F32, 150000.0), (F32, 10000.0), (F32, 0.0), (F32, math.nan), (STRING, "1e4"))]
    mutations += [values(BASE, {f"{rope}.scaling.type": (STRING, kind)}) for kind in ("none", "linear", "longrope", "")]
    mutations += [values(BASE, {key: typed}) for key, typed in (
        (f"{rope}.scaling.factor", (F32, 0.0)), (f"{rope}.scaling.factor", (F32, -8.0)),
        (f"{rope}.scaling.factor", (F32, math.nan)), (f"{rope}.scaling.factor", (None, None)),
        (f"{rope}.scaling.yarn_beta_fast", (F32, 16.0)), (f"{rope}.scaling.yarn_beta_slow", (F32, math.nan)),
        (f"{rope}.freq_base", (F32, -1.0)), (f"{rope}.freq_base", (None, None)))]
    mutations += [added_entry(BASE, f"{ARCH}.{key}", *typed) for key, typed in (
        ("expert_shared_count", (U32, 1)), ("rope.dimension_count", (U32, 8)), ("expert_gating_func", (U32, 2)),
        ("rope.scaling.yarn_ext_factor", (F32, 0.0)), ("rope.scaling.yarn_attn_factor", (F32, 2.0)),
        ("rope.scaling.yarn_log_multiplier", (F32, 0.1)), ("attention.logit_softcapping", (F32, 30.0)))]
    return mutations


def _tensors() -> list[Mutation]:
    blk = "blk.0."
    dims = [(blk + name, shape) for name, shape in (  # ggml's order: [columns, rows, experts]
        ("attn_sinks.weight", (3,)), ("attn_sinks.weight", (4, 1)), ("attn_sinks.weight", (1, 4)),
        ("attn_sinks.weight", (5,)), ("ffn_gate_exps.weight", (64, 32, 3)), ("ffn_gate_exps.weight", (64, 32, 5)),
        ("ffn_gate_exps.weight", (32, 64, 4)), ("ffn_gate_exps.weight", (64, 31, 4)), ("ffn_gate_exps.weight", (48, 32, 4)),
        ("ffn_gate_exps.weight", (64, 128)), ("ffn_up_exps.weight", (64, 32, 4, 1)), ("ffn_down_exps.weight", (32, 64, 5)),
        ("ffn_down_exps.weight", (64, 32, 4)), ("ffn_down_exps.weight", (31, 64, 4)), ("ffn_gate_exps.bias", (32, 3)),
        ("ffn_gate_exps.bias", (31, 4)), ("ffn_gate_exps.bias", (128,)), ("ffn_down_exps.bias", (64, 5)),
        ("ffn_gate_inp.weight", (64, 5)), ("ffn_gate_inp.bias", (3,)))]
    mutations = [tensors(BASE, gguf.reshaped(name, shape)) for name, shape in dims]
    mutations += [tensors(BASE, gguf.reshaped(blk + name, ggml_type=t)) for name, t in (
        ("ffn_gate_exps.weight", 8), ("ffn_gate_exps.weight", 0), ("ffn_down_exps.weight", 2), ("ffn_up_exps.weight", 40),
        ("attn_sinks.weight", 39), ("attn_sinks.weight", 1), ("ffn_gate_exps.bias", 39), ("attn_q.weight", 39),
        ("ffn_gate_inp.weight", 39))]
    renames = (("attn_sinks.weight", "blk.0.attn_sink.weight"), ("attn_sinks.weight", "blk.1.attn_sinks.weight"),
               ("ffn_gate_exps.weight", "blk.1.ffn_gate_exps.weight"), ("ffn_up_exps.bias", "blk.0.ffn_up.bias"),
               ("ffn_down_exps.weight", "blk.0.ffn_down.weight"))
    mutations += [tensors(BASE, gguf.renamed(blk + name, new)) for name, new in renames]
    for name in ("attn_sinks.weight", "ffn_up_exps.bias", "ffn_gate_inp.bias", "attn_output.bias"):
        mutations.append(tensors(BASE, gguf.edit_tensors(f"tensor {blk}{name} dropped", lambda infos, name=name: [
            gguf.encode_tensor(t) for t in infos if t.name != blk + name])))
    # an MXFP4 block is a scale byte then 16 bytes of nibbles: 255 and 253-254 (with a large nibble) overflow fp32
    mutations += [tensors(BASE, gguf.patched_weight(blk + name, index, value, "<B", "byte")) for name, index, value in (
        ("ffn_down_exps.weight", 0, 255), ("ffn_down_exps.weight", 17, 254), ("ffn_gate_exps.weight", 34, 253),
        ("ffn_up_exps.weight", 0, 252), ("ffn_up_exps.weight", 51, 0), ("ffn_down_exps.weight", 1, 0x77))]
    mutations += [tensors(BASE, gguf.patched_weight(blk + name, 0, value)) for name, value in (
        ("attn_sinks.weight", math.nan), ("attn_sinks.weight", -math.inf), ("ffn_gate_exps.bias", math.inf),
        ("ffn_gate_inp.bias", math.nan))]
    return mutations


def gpt_oss_gguf_catalog() -> list[Mutation]:
    return _metadata() + _tensors()
