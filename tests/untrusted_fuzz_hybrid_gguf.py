"""Hybrid GGUF mutations for the untrusted-input fuzzer (tests/untrusted_fuzz_hybrid.py holds the group), made
from the `qwen3next` and `lfm2` files llama.cpp's converter wrote (tests/untrusted_fuzz_bases.py): the
metadata that becomes the recurrent layers' config (`ssm.*`, `attention.recurrent_layers`,
`full_attention_interval`, `expert_shared_feed_forward_length`, the experts, the partial rotary's
`rope.dimension_count`; LFM2's `shortconv.l_cache` and per-layer `attention.head_count_kv`) given extreme,
zero, mistyped, short or long values; the Gated DeltaNet's and the short conv's tensor infos (dims, types,
names) and values (`ssm_a` = -exp(A_log) made positive, zero, NaN, infinite). Written by the fuzzer's parent
process, each under its case's folder.
"""

from __future__ import annotations

import math
import random

import untrusted_fuzz_gguf as gguf
from untrusted_fuzz_gguf_layout import (
    ARRAY,
    BOOL,
    F32,
    I8,
    I32,
    STRING,
    U8,
    U32,
    U64,
    encode_entry,
    read_layout,
)
from untrusted_mutation import HUGE_INTS, Bases, Mutation, kind_of, on_base

GGUF_LABELS = {"next_gguf": "Qwen3-Next GGUF", "lfm2_gguf": "LFM2 GGUF", "granite_gguf": "Granite 4.0-H GGUF",
               "gpt_oss_gguf": "gpt-oss GGUF", "olmo3_gguf": "OLMo 3 GGUF", "smollm3_gguf": "SmolLM3 GGUF",
               "exaone4_gguf": "Exaone 4 GGUF"}
NEXT, LFM2 = "qwen3next", "lfm2"
_ITEM_NAMES = {U8: "u8", I8: "i8", U32: "u32", I32: "i32", F32: "f32", BOOL: "bool", STRING: "string"}
# header numbers and tensors whose random edits are this group's (the others are the llama file's groups')
_HYBRID_PARTS = ("ssm", "recurrent", "shortconv", "shexp", "exps", "attn_qkv", "attn_gate", "head_count_kv",
                 "expert", "full_attention_interval", "rope.dimension_count")


def values(base: str, entries: dict[str, tuple[int | None, object]]) -> Mutation:
    """Metadata entries of the base file given (type, value)s; None drops one."""
    kind = kind_of(base, "gguf")
    return on_base(gguf.set_values(kind, entries), base, kind, GGUF_LABELS[base])


def array(base: str, key: str, item_type: int, items: list) -> Mutation:
    """Metadata entry `key` made an array of `item_type`."""
    shown = f"{key} = {items!r} ({_ITEM_NAMES[item_type]} array)"
    change = {key: encode_entry(key, ARRAY, items, item_type)}
    kind = kind_of(base, "gguf")
    return on_base(gguf.rebuilt(kind, shown, entries=lambda layout: change), base, kind, GGUF_LABELS[base])


def added_entry(base: str, key: str, value_type: int, value: object, item_type: int | None = None) -> Mutation:
    """A metadata entry the base file lacks (values() and array() replace only those it has), added after its
    others."""
    names = {**_ITEM_NAMES, ARRAY: f"{_ITEM_NAMES.get(item_type)} array"}
    kind = kind_of(base, "gguf")
    mutation = gguf.rebuilt(kind, f"{key} = {value!r} ({names[value_type]}) added", extra=(encode_entry(key, value_type, value, item_type),))
    return on_base(mutation, base, kind, GGUF_LABELS[base])


def tensors(base: str, mutation: Mutation) -> Mutation:
    return on_base(mutation, base, kind_of(base, "tensors"), GGUF_LABELS[base])


def _next_metadata() -> list[Mutation]:
    base, ssm = "next_gguf", f"{NEXT}.ssm"
    numbers = [(f"{ssm}.conv_kernel", (0, 1, 3, 5, 65, 2**32 - 1)), (f"{ssm}.state_size", (0, 8, 32, 2**31)),
               (f"{ssm}.group_count", (0, 1, 3, 4, 2**32 - 1)), (f"{ssm}.time_step_rank", (0, 2, 3, 8, 2**32 - 1)),
               (f"{ssm}.inner_size", (0, 32, 63, 128, 2**32 - 1)),
               (f"{NEXT}.expert_shared_feed_forward_length", (0, 47, 96, 2**31, 2**32 - 1)),
               (f"{NEXT}.expert_count", (0, 4, 9, 2**31)), (f"{NEXT}.expert_used_count", (0, 9, 2**32 - 1)),
               (f"{NEXT}.expert_feed_forward_length", (0, 33)),
               (f"{NEXT}.rope.dimension_count", (0, 7, 33, 2**31)),
               (f"{NEXT}.attention.key_length", (0, 16)), (f"{NEXT}.attention.value_length", (16, 0)),
               (f"{NEXT}.block_count", (1, 3))]
    mutations = [values(base, {key: (U32, v)}) for key, vs in numbers for v in vs]
    for key in (f"{ssm}.conv_kernel", f"{ssm}.inner_size", f"{ssm}.group_count",
                f"{NEXT}.expert_shared_feed_forward_length"):
        mutations += [values(base, {key: typed}) for typed in ((STRING, "4"), (F32, 4.0), (F32, math.nan),
                                                              (I32, -4), (BOOL, True), (U64, 2**63), (None, None))]
    for key in (f"{ssm}.state_size", f"{ssm}.time_step_rank"):
        mutations.append(values(base, {key: (None, None)}))
    flags, interval = f"{NEXT}.attention.recurrent_layers", f"{NEXT}.full_attention_interval"
    mutations += [array(base, flags, BOOL, items) for items in (
        [True], [True, False, True], [True, True], [False, False], [False, True], [])]
    mutations += [array(base, flags, item_type, items) for item_type, items in (
        (U32, [1, 0]), (I8, [1, 0]), (U8, [2, 0]), (STRING, ["true", "false"]), (F32, [1.0, 0.0]))]
    mutations += [values(base, {flags: typed}) for typed in ((BOOL, True), (U32, 1), (STRING, "1,0"))]
    mutations += [values(base, {flags: (None, None), interval: typed}) for typed in (
        (U32, 0), (U32, 1), (U32, 2), (U32, 3), (U32, 2**32 - 1), (I32, -2), (F32, math.nan), (STRING, "2"),
        (BOOL, True))]
    mutations.append(values(base, {flags: (None, None), interval: (None, None)}))
    mutations.append(values(base, {interval: (U32, 0)}))  # beside the flags, which win
    return mutations


def _lfm2_metadata() -> list[Mutation]:
    base, cache, counts = "lfm2_gguf", f"{LFM2}.shortconv.l_cache", f"{LFM2}.attention.head_count_kv"
    mutations = [values(base, {cache: (U32, v)}) for v in (0, 1, 2, 4, 64, 65, 2**32 - 1)]
    mutations += [values(base, {cache: typed}) for typed in ((STRING, "3"), (F32, 3.0), (I32, -3), (BOOL, True),
                                                              (None, None))]
    mutations += [array(base, counts, U32, items) for items in (
        [0], [0, 2, 2], [0, 0], [2, 2], [2, 0], [0, 3], [0, 1], [0, 2**32 - 1], [0, 1024], [0, 1025], [])]
    mutations += [array(base, counts, item_type, items) for item_type, items in (
        (I32, [-1, 2]), (I32, [0, 2]), (STRING, ["0", "2"]), (BOOL, [False, True]), (F32, [0.0, 2.0]))]
    mutations += [values(base, {counts: typed}) for typed in ((U32, 2), (U32, 0), (STRING, "2"), (None, None))]
    mutations += [values(base, {key: (U32, v)}) for key, vs in ((f"{LFM2}.feed_forward_length", (0, 97, 128)),
                                                                (f"{LFM2}.vocab_size", (0, 2**31))) for v in vs]
    mutations.append(values(base, {f"{LFM2}.attention.layer_norm_rms_epsilon": (None, None)}))
    return mutations


def _next_tensors() -> list[Mutation]:
    base = "next_gguf"
    dims = [("blk.0.ssm_ba.weight", (64, 7)), ("blk.0.ssm_ba.weight", (64, 4)), ("blk.0.ssm_ba.weight", (63, 8)),
            ("blk.0.ssm_ba.weight", (64, 8, 1)), ("blk.0.ssm_ba.weight", (8, 64)),
            ("blk.0.attn_qkv.weight", (64, 127)), ("blk.0.attn_qkv.weight", (64, 96)),
            ("blk.0.attn_qkv.weight", (63, 128)), ("blk.0.attn_qkv.weight", (128, 64)),
            ("blk.0.attn_gate.weight", (64, 63)), ("blk.0.ssm_conv1d.weight", (3, 128)),
            ("blk.0.ssm_conv1d.weight", (4, 127)), ("blk.0.ssm_conv1d.weight", (4, 128, 1)),
            ("blk.0.ssm_conv1d.weight", (128, 4)), ("blk.0.ssm_a", (3,)), ("blk.0.ssm_a", (2, 2)),
            ("blk.0.ssm_a", (1,)), ("blk.0.ssm_dt.bias", (3,)), ("blk.0.ssm_norm.weight", (15,)),
            ("blk.0.ssm_out.weight", (63, 64)), ("blk.0.ffn_gate_inp_shexp.weight", (64, 2)),
            ("blk.0.ffn_gate_inp_shexp.weight", (64,)), ("blk.0.ffn_up_shexp.weight", (64, 47)),
            ("blk.0.ffn_gate_exps.weight", (64, 32, 7)), ("blk.0.ffn_down_exps.weight", (32, 64, 4))]
    mutations = [tensors(base, gguf.reshaped(name, shape)) for name, shape in dims]
    mutations += [tensors(base, gguf.reshaped(name, ggml_type=t)) for name, t in (
        ("blk.0.ssm_a", 1), ("blk.0.ssm_conv1d.weight", 8), ("blk.0.ssm_ba.weight", 1), ("blk.0.ssm_a", 30))]
    renames = (("blk.0.ssm_a", "blk.1.ssm_a"), ("blk.0.ssm_ba.weight", "blk.0.ssm_alpha.weight"),
               ("blk.0.ssm_conv1d.weight", "blk.1.ssm_conv1d.weight"),
               ("blk.0.attn_qkv.weight", "blk.1.attn_qkv.weight"))
    mutations += [tensors(base, gguf.renamed(name, new)) for name, new in renames]
    for name in ("blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.ffn_gate_inp_shexp.weight"):
        mutations.append(tensors(base, gguf.edit_tensors(f"tensor {name} dropped", lambda infos, name=name: [
            gguf.encode_tensor(t) for t in infos if t.name != name])))
    for index, value in ((0, 1.0), (4, 0.0), (8, -0.0), (12, math.nan), (0, -math.inf), (4, math.inf),
                         (8, -1e-45), (12, -3e38)):
        mutations.append(tensors(base, gguf.patched_weight("blk.0.ssm_a", index, value)))
    mutations += [tensors(base, gguf.patched_weight(name, 0, value)) for name, value in (
        ("blk.0.ssm_dt.bias", math.nan), ("blk.0.ssm_conv1d.weight", math.inf),
        ("blk.0.ssm_norm.weight", math.nan), ("blk.0.ffn_gate_inp_shexp.weight", -math.inf))]
    return mutations


def _lfm2_tensors() -> list[Mutation]:
    base, conv = "lfm2_gguf", "blk.0.shortconv."
    mutations = [tensors(base, gguf.reshaped(conv + name, shape)) for name, shape in (
        ("conv.weight", (2, 64)), ("conv.weight", (4, 64)), ("conv.weight", (3, 63)), ("conv.weight", (3, 64, 1)),
        ("conv.weight", (64, 3)), ("in_proj.weight", (64, 191)), ("in_proj.weight", (64, 128)),
        ("out_proj.weight", (63, 64)))]
    mutations += [tensors(base, gguf.renamed(conv + "conv.weight", "blk.1.shortconv.conv.weight")),
                  tensors(base, gguf.edit_tensors(f"tensor {conv}in_proj.weight dropped", lambda infos: [
                      gguf.encode_tensor(t) for t in infos if t.name != conv + "in_proj.weight"])),
                  tensors(base, gguf.patched_weight(conv + "conv.weight", 8, math.nan))]
    return mutations


def gguf_catalog() -> list[Mutation]:
    return _next_metadata() + _lfm2_metadata() + _next_tensors() + _lfm2_tensors()


def gguf_drawn(rng: random.Random, bases: Bases, base: str, parts: tuple[str, ...] = _HYBRID_PARTS) -> Mutation:
    """A random number of the base file's header that belongs to a hybrid part (a key or a tensor info whose
    name holds one of `parts`) set to a random extreme, or a random hybrid metadata key given a random type
    and value."""
    layout = read_layout(getattr(bases, base))
    if rng.random() < 0.5:
        field = rng.choice([f for f in layout.fields if any(part in f.name for part in parts)])
        number = rng.choice((0, 1, field.value - 1, field.value + 1, 2 * field.value, *HUGE_INTS))
        kind = kind_of(base, "tensors" if "'blk." in field.name else "gguf")
        return on_base(gguf.set_field(field.name, number), base, kind, GGUF_LABELS[base])
    key = rng.choice([e.key for e in layout.entries if any(part in e.key for part in parts)])
    kind, value = rng.choice(((U32, rng.choice(HUGE_INTS[:2])), (U32, 0), (U32, rng.randrange(1, 200)),
                              (I32, -rng.randrange(1, 2**31)), (F32, rng.choice((math.nan, -math.inf, 1e38))),
                              (STRING, "x" * rng.randrange(3)), (BOOL, False), (U64, rng.choice(HUGE_INTS)),
                              (ARRAY, ["1"]), (None, None)))
    return values(base, {key: (kind, value)})
