"""Granite 4.0-H GGUF mutations for the untrusted-input fuzzer (tests/untrusted_fuzz_granite.py holds the group),
made from the `granitehybrid` file llama.cpp's converter wrote (tests/untrusted_fuzz_bases.py) with the hybrid
group's helpers (tests/untrusted_fuzz_hybrid_gguf.py): the metadata that becomes the Mamba2 layers' config
(`ssm.*`), the layer kinds (`attention.head_count_kv`, 0 a Mamba2 layer), the four multipliers
(`attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`), RoPE or NoPE
(`rope.scaling.finetuned`, `rope.dimension_count`, `rope.freq_base`), the shared MLP's width and the experts,
given extreme, zero, negative, non-finite, mistyped, short or long values; the Mamba2 tensors' infos (dims,
types, names) and values (`ssm_a` = -exp(A_log) made positive, zero, NaN, infinite). Written by the fuzzer's
parent process, each under its case's folder.
"""

from __future__ import annotations

import math

import untrusted_fuzz_gguf as gguf
from untrusted_fuzz_gguf_layout import ARRAY, BOOL, F32, I32, STRING, U32, U64
from untrusted_fuzz_hybrid_gguf import added_entry, array, tensors, values
from untrusted_mutation import Mutation

BASE, ARCH = "granite_gguf", "granitehybrid"
SSM = f"{ARCH}.ssm"
MULTIPLIER_KEYS = tuple(f"{ARCH}.{key}" for key in ("attention.scale", "embedding_scale", "residual_scale",
                                                    "logit_scale"))
# header numbers and tensors whose random edits are the group's (tests/untrusted_fuzz_hybrid_gguf.gguf_drawn)
GRANITE_PARTS = ("ssm", "head_count", "expert", "scale", "rope", "feed_forward_length")
_ODD_TYPES = ((STRING, "4"), (F32, 4.0), (F32, math.nan), (I32, -4), (BOOL, True), (U64, 2**63), (None, None))


def _ssm_metadata() -> list[Mutation]:
    numbers = [(f"{SSM}.conv_kernel", (0, 1, 2, 3, 5, 65, 2**32 - 1)), (f"{SSM}.state_size", (0, 8, 32, 1025, 2**31)),
               (f"{SSM}.group_count", (0, 1, 3, 4, 2**32 - 1)),
               (f"{SSM}.inner_size", (0, 32, 48, 63, 128, 2**32 - 1)),
               (f"{SSM}.time_step_rank", (0, 1, 2, 3, 8, 64, 2**32 - 1))]
    mutations = [values(BASE, {key: (U32, v)}) for key, vs in numbers for v in vs]
    mutations += [values(BASE, {key: typed}) for key, _ in numbers for typed in _ODD_TYPES]
    # the same widths split another way: 8 heads of 8, 4 groups of a state of 8
    mutations += [values(BASE, {f"{SSM}.time_step_rank": (U32, 8), f"{SSM}.inner_size": (U32, 64)}),
                  values(BASE, {f"{SSM}.group_count": (U32, 4), f"{SSM}.state_size": (U32, 8)})]
    return mutations


def _model_metadata() -> list[Mutation]:
    mutations = [values(BASE, {key: typed}) for key in MULTIPLIER_KEYS for typed in (
        (F32, 0.0), (F32, -1.0), (F32, -0.0), (F32, math.nan), (F32, math.inf), (F32, -math.inf), (F32, 1e-45),
        (U32, 3), (I32, -1), (STRING, "0.6"), (BOOL, True), (None, None))]
    rope, finetuned = f"{ARCH}.rope", f"{ARCH}.rope.scaling.finetuned"
    mutations += [values(BASE, {finetuned: typed}) for typed in ((BOOL, True), (U32, 1), (U32, 0),
                                                                  (STRING, "false"), (None, None))]
    for key, vs in ((f"{rope}.dimension_count", (0, 16, 33, 2**31)), (f"{rope}.freq_base", (0.0, -1.0, math.nan))):
        kind = U32 if isinstance(vs[0], int) else F32
        mutations += [values(BASE, {finetuned: (BOOL, True), key: (kind, v)}) for v in vs]
    mutations.append(values(BASE, {f"{rope}.dimension_count": (U32, 16)}))  # beside NoPE: unread
    counts = f"{ARCH}.attention.head_count_kv"
    mutations += [array(BASE, counts, U32, items) for items in (
        [0], [0, 2, 2], [0, 0], [2, 2], [2, 0], [0, 1], [0, 3], [0, 2**32 - 1], [0, 1025], [])]
    mutations += [array(BASE, counts, item_type, items) for item_type, items in (
        (I32, [-1, 2]), (U32, [0, 2]), (STRING, ["0", "2"]), (BOOL, [False, True]), (F32, [0.0, 2.0]))]
    mutations += [values(BASE, {counts: typed}) for typed in ((U32, 2), (U32, 0), (STRING, "0,2"), (None, None))]
    numbers = ((f"{ARCH}.expert_count", (1, 8, 2**32 - 1)), (f"{ARCH}.expert_used_count", (0, 9, 2**32 - 1)),
               (f"{ARCH}.expert_shared_feed_forward_length", (0, 95, 97, 128, 2**31)),
               (f"{ARCH}.feed_forward_length", (0, 96, 2**31)), (f"{ARCH}.attention.head_count", (0, 1, 4)),
               (f"{ARCH}.block_count", (1, 3)))
    mutations += [values(BASE, {key: (U32, v)}) for key, vs in numbers for v in vs]
    for key in (f"{ARCH}.expert_count", f"{ARCH}.expert_shared_feed_forward_length"):
        mutations += [values(BASE, {key: typed}) for typed in ((STRING, "0"), (F32, 96.0), (I32, -1), (None, None))]
    mutations.append(values(BASE, {f"{ARCH}.expert_shared_feed_forward_length": (ARRAY, ["96"])}))
    # keys the converter leaves out (the head size is hidden / heads): added
    mutations += [added(f"{ARCH}.attention.{key}", v) for key in ("key_length", "value_length") for v in (0, 16, 64)]
    return mutations


def added(key: str, value: int) -> Mutation:
    """A u32 metadata entry the base file lacks, added after its others."""
    return added_entry(BASE, key, U32, value)


def _tensors() -> list[Mutation]:
    blk = "blk.0."
    dims = [(blk + name, shape) for name, shape in (
        ("ssm_in.weight", (64, 195)), ("ssm_in.weight", (63, 196)), ("ssm_in.weight", (196, 64)),
        ("ssm_in.weight", (64, 196, 1)), ("ssm_conv1d.weight", (3, 128)), ("ssm_conv1d.weight", (4, 127)),
        ("ssm_conv1d.weight", (128, 4)), ("ssm_conv1d.weight", (4, 128, 1)), ("ssm_conv1d.bias", (127,)),
        ("ssm_conv1d.bias", (1, 128)), ("ssm_a", (1, 3)), ("ssm_a", (4,)), ("ssm_a", (2, 2)), ("ssm_a", (4, 1)),
        ("ssm_a", (1,)), ("ssm_d", (1, 3)), ("ssm_d", (4,)), ("ssm_d", (2, 2)), ("ssm_dt.bias", (3,)),
        ("ssm_dt.bias", (1, 4)), ("ssm_norm.weight", (64,)), ("ssm_norm.weight", (2, 32)),
        ("ssm_norm.weight", (16, 4)), ("ssm_norm.weight", (31, 2)), ("ssm_out.weight", (63, 64)),
        ("ssm_out.weight", (64, 63)))]
    mutations = [tensors(BASE, gguf.reshaped(name, shape)) for name, shape in dims]
    mutations += [tensors(BASE, gguf.reshaped(blk + name, ggml_type=t)) for name, t in (
        ("ssm_a", 1), ("ssm_a", 26), ("ssm_d", 26), ("ssm_dt.bias", 24), ("ssm_norm.weight", 26),
        ("ssm_conv1d.weight", 8), ("ssm_conv1d.bias", 30), ("ssm_in.weight", 8), ("ssm_out.weight", 26))]
    renames = (("ssm_a", "blk.1.ssm_a"), ("ssm_in.weight", "blk.1.ssm_in.weight"), ("ssm_d", "blk.0.ssm_D"),
               ("ssm_norm.weight", "blk.0.ssm_norm.bias"), ("ssm_conv1d.weight", "blk.0.shortconv.conv.weight"),
               ("ssm_out.weight", "blk.0.attn_output.weight"))
    mutations += [tensors(BASE, gguf.renamed(blk + name, new)) for name, new in renames]
    mutations.append(tensors(BASE, gguf.renamed("blk.1.attn_q.weight", "blk.0.attn_q.weight")))
    for name in ("ssm_a", "ssm_d", "ssm_dt.bias", "ssm_norm.weight", "ssm_conv1d.bias", "ssm_in.weight"):
        mutations.append(tensors(BASE, gguf.edit_tensors(f"tensor {blk}{name} dropped", lambda infos, name=name: [
            gguf.encode_tensor(t) for t in infos if t.name != blk + name])))
    for index, value in ((0, 1.0), (4, 0.0), (8, -0.0), (12, math.nan), (0, -math.inf), (4, math.inf),
                         (8, -1e-45), (12, -3e38)):
        mutations.append(tensors(BASE, gguf.patched_weight(blk + "ssm_a", index, value)))
    mutations += [tensors(BASE, gguf.patched_weight(blk + name, 0, value)) for name, value in (
        ("ssm_d", math.nan), ("ssm_dt.bias", math.inf), ("ssm_conv1d.weight", math.nan),
        ("ssm_conv1d.bias", -math.inf), ("ssm_norm.weight", math.nan), ("ssm_in.weight", math.inf),
        ("ssm_out.weight", math.nan))]
    return mutations


def granite_gguf_catalog() -> list[Mutation]:
    return _ssm_metadata() + _model_metadata() + _tensors()
