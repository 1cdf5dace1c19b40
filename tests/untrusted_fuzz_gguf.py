"""GGUF mutations for the untrusted-input fuzzer (tests/untrusted_fuzz.py), made from the base GGUF file
(tests/untrusted_fuzz_gguf_layout.py takes it apart): every number of the header overwritten with
extremes, nested arrays, `general.alignment`, the metadata values that become the config and the
tokenizer, the tensor list, truncations and non-finite weights. `catalog()` is the named list; `drawn`
a random one from a seeded generator.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from pathlib import Path

from untrusted_fuzz_gguf_layout import (
    ARRAY,
    BOOL,
    F32,
    GGML_F32,
    I32,
    STRING,
    U32,
    U64,
    Layout,
    TensorInfo,
    assemble,
    encode_entry,
    encode_tensor,
    encode_value,
    read_layout,
)
from untrusted_mutation import HUGE_INTS, Bases, Mutation

ARCH = "llama"
_TYPE_NAMES = {U32: "u32", I32: "i32", U64: "u64", F32: "f32", BOOL: "bool", STRING: "string", ARRAY: "array"}
Value = int | Callable[[Layout, int], int]  # a number, or one computed from the base (its layout, its size)


def _write(folder: Path, data: bytes) -> str:
    path = folder / "model.gguf"
    path.write_bytes(data)
    return str(path)


def _base_bytes(bases: Bases) -> bytes:
    return Path(bases.gguf).read_bytes()


def set_field(name: str, value: Value, shown: str | None = None, kind: str = "gguf-header") -> Mutation:
    """The header number `name` (a Field's name) overwritten, in its own width, with `value`."""

    def make(bases: Bases, folder: Path) -> str:
        data, layout = bytearray(_base_bytes(bases)), read_layout(bases.gguf)
        field = layout.field(name)
        number = value(layout, len(data)) if callable(value) else value
        data[field.at : field.at + field.width] = (number % 2 ** (8 * field.width)).to_bytes(field.width, "little")
        return _write(folder, bytes(data))

    return Mutation(kind, f"{name} = {shown or value}", "model", make)


def rebuilt(kind: str, description: str, entries: Callable[[Layout], dict[str, bytes | None]] | None = None,
            extra: tuple[bytes, ...] = (), tensors: Callable[[Layout], list[bytes]] | None = None,
            alignment: int = 32) -> Mutation:
    """The base put back together with entries replaced (by key: new bytes, or None to drop), `extra` entries
    added, the tensor infos replaced, or the data section realigned."""

    def make(bases: Bases, folder: Path) -> str:
        layout = read_layout(bases.gguf)
        changes = entries(layout) if entries else {}
        raw = [changes.get(e.key, encode_entry(e.key, e.value_type, e.value, e.item_type)) for e in layout.entries]
        infos = tensors(layout) if tensors else [encode_tensor(t) for t in layout.tensors]
        kept = [r for r in raw if r is not None] + list(extra)
        return _write(folder, assemble(kept, infos, layout.data, alignment))

    return Mutation(kind, description, "model", make)


def set_values(kind: str, values: dict[str, tuple[int, object]], note: str = "") -> Mutation:
    """Metadata entries given new (type, value)s; a None type drops the key."""
    shown = ", ".join(f"{k} = {'(dropped)' if t is None else f'{v!r} ({_TYPE_NAMES[t]})'}"
                      for k, (t, v) in values.items())
    changes = {k: None if t is None else encode_entry(k, t, v, STRING if t == ARRAY else None)
               for k, (t, v) in values.items()}
    return rebuilt(kind, shown + note, entries=lambda layout: changes)


def edit_tokens(description: str, edit: Callable[[list], list], key: str = "tokenizer.ggml.tokens",
                item_type: int = STRING) -> Mutation:
    def entries(layout: Layout) -> dict[str, bytes | None]:
        return {key: encode_entry(key, ARRAY, edit(list(layout.entry(key).value)), item_type)}

    return rebuilt("gguf-tokenizer", f"{key}: {description}", entries=entries)


def edit_tensors(description: str, edit: Callable[[list[TensorInfo]], list[bytes]]) -> Mutation:
    return rebuilt("gguf-tensors", description, tensors=lambda layout: edit(list(layout.tensors)))


def renamed(name: str, new_name: str | bytes) -> Mutation:
    return edit_tensors(f"tensor {name} renamed {new_name!r}", lambda infos: [
        encode_tensor(t, new_name if t.name == name else None) for t in infos])


def reshaped(name: str, dims: tuple[int, ...] | None = None, ggml_type: int | None = None) -> Mutation:
    def edit(infos: list[TensorInfo]) -> list[bytes]:
        return [encode_tensor(TensorInfo(t.name, dims or t.dims, t.ggml_type if ggml_type is None else ggml_type,
                                         t.offset) if t.name == name else t) for t in infos]

    what = f"dims {list(dims)}" if dims else f"ggml type {ggml_type}"
    return edit_tensors(f"tensor {name} given {what}", edit)


def truncated(shown: str, at: Callable[[Layout, int], int]) -> Mutation:
    def make(bases: Bases, folder: Path) -> str:
        data = _base_bytes(bases)
        return _write(folder, data[: at(read_layout(bases.gguf), len(data))])

    return Mutation("gguf-truncate", f"cut at {shown}", "model", make)


def patched_weight(name: str, index: int, value: float, fmt: str = "<f", what: str = "value") -> Mutation:
    """The `index`-th value (or Q8_0 block scale) of tensor `name` set to a non-finite number."""

    def make(bases: Bases, folder: Path) -> str:
        data, layout = bytearray(_base_bytes(bases)), read_layout(bases.gguf)
        at = layout.data_at + layout.tensor(name).offset + index
        data[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
        return _write(folder, bytes(data))

    return Mutation("gguf-weights", f"{name}: {what} at byte {index} = {value}", "model", make)


def _nested(depth: int) -> bytes:
    """An entry whose value is an array nested `depth` deep (one u32 at the bottom)."""
    head = encode_entry("fuzz.nested", ARRAY, [], U32)[:-12]  # the key and its type, ARRAY
    return head + struct.pack("<IQ", ARRAY, 1) * (depth - 1) + encode_value(ARRAY, [7], U32)


def _header() -> list[Mutation]:
    q, k, out = "'blk.0.attn_q.weight'", "'blk.0.attn_k.weight'", "'output.weight'"
    fields = [("version", (0, 1, 4, 2**32 - 1)), ("tensor count", (0, 22, 2**63, 2**64 - 1)),
              ("metadata count", (0, 19, 2**64 - 1)), ("'general.architecture' key length", (0, 2**63, 2**64 - 1)),
              ("'llama.block_count' value type", (STRING, ARRAY, U64, 13, 2**32 - 1)),
              ("'tokenizer.ggml.tokens' item type", (0, ARRAY, 13, 2**32 - 1)),
              ("'tokenizer.ggml.tokens' count", (0, 511, 513, 2**62, 2**64 - 1)),
              ("'tokenizer.ggml.tokens'[0] length", (0, 2**63)), ("'tokenizer.ggml.merges' count", (2**64 - 1,)),
              (f"{q} n_dims", (0, 5, 2**32 - 1)), (f"{q} dims[0]", (0, 2**40, 2**32 - 1)),
              (f"{k} dims[1]", (0, 2**63)),
              (f"{q} ggml type", (1, 4, 8, 99, 2**32 - 1))]
    mutations = [set_field(name, v) for name, values in fields for v in values]
    mutations += [set_field(f"{out} offset", lambda layout, size: size, "the file's size"),
                  set_field(f"{out} offset", 2**64 - 64),
                  set_field(f"{out} offset", lambda layout, size: layout.tensor("output.weight").offset + 4, "+4"),
                  set_field(f"{out} offset", 0, "0 (token_embd's)")]
    nested_types = lambda layout: {"tokenizer.ggml.token_type": encode_entry(  # noqa: E731
        "tokenizer.ggml.token_type", ARRAY, [(I32, [1, 1])] * 512, ARRAY)}
    mutations += [rebuilt("gguf-header", "tokenizer.ggml.token_type an array of arrays", entries=nested_types),
                  rebuilt("gguf-header", "an extra key nested 3 arrays deep", extra=(_nested(3),)),
                  rebuilt("gguf-header", "an extra key nested 100000 arrays deep", extra=(_nested(100_000),)),
                  rebuilt("gguf-header", "an extra key not UTF-8", extra=(encode_entry(b"\xff\xfe", U32, 1),)),
                  rebuilt("gguf-header", "llama.block_count twice (2, then 5)",
                          extra=(encode_entry("llama.block_count", U32, 5),))]
    for value, alignment in ((0, 32), (3, 32), (2**31, 32), (2**32 - 1, 32), (64, 64), (16, 16)):
        mutations.append(rebuilt("gguf-header", f"general.alignment = {value} (u32)", alignment=alignment,
                                 extra=(encode_entry("general.alignment", U32, value),)))
    mutations += [rebuilt("gguf-header", "general.alignment = '32' (string)",
                          extra=(encode_entry("general.alignment", STRING, "32"),)),
                  rebuilt("gguf-header", "general.alignment = 2^63 (u64)",
                          extra=(encode_entry("general.alignment", U64, 2**63),))]
    return mutations


def _config() -> list[Mutation]:
    a, t = f"{ARCH}.attention", "tokenizer.ggml"
    numbers = [(f"{ARCH}.block_count", U32, (0, 1, 3, 10**7, 2**32 - 1)),
               (f"{ARCH}.embedding_length", U32, (0, 255, 2**31)), (f"{ARCH}.context_length", U64, (0, 2**40)),
               (f"{a}.head_count", U32, (0, 3)), (f"{a}.head_count_kv", U32, (0, 3, 2**32 - 1)),
               (f"{a}.layer_norm_rms_epsilon", F32, (math.nan, math.inf, -1.0, 0.0)),
               (f"{ARCH}.rope.freq_base", F32, (-10000.0, math.nan, 0.0)),
               (f"{ARCH}.feed_forward_length", U32, (0, 2**31)),
               (f"{ARCH}.rope.dimension_count", U32, (0, 3, 2**20)), (f"{ARCH}.vocab_size", U32, (0, 511, 2**31)),
               (f"{t}.bos_token_id", U32, (512, 2**32 - 1)), (f"{t}.eos_token_id", U32, (512, 2**32 - 1))]
    mutations = [set_values("gguf-config", {key: (kind, v)}) for key, kind, values in numbers for v in values]
    mutations += [set_values("gguf-config", {f"{a}.head_count": (U32, 4), f"{a}.head_count_kv": (U32, 3)}),
                  set_values("gguf-config", {f"{t}.bos_token_id": (I32, -1)})]
    block_count = f"{ARCH}.block_count"
    mutations += [set_values("gguf-config", {block_count: (kind, v)})
                  for kind, v in ((STRING, "2"), (F32, 2.0), (BOOL, True), (I32, -1), (ARRAY, ["2"]))]
    mutations += [set_values("gguf-config", {"general.architecture": (kind, v)})
                  for kind, v in ((STRING, "nope"), (STRING, ""), (U32, 7), (None, None))]
    mutations += [set_values("gguf-config", {key: (None, None)})
                  for key in (block_count, f"{ARCH}.embedding_length", f"{a}.head_count")]
    return mutations


def _tokenizer() -> list[Mutation]:
    return [
        edit_tokens("token 300 a copy of token 299", lambda items: items[:300] + [items[299]] + items[301:]),
        edit_tokens("token 300 empty", lambda items: items[:300] + [""] + items[301:]),
        edit_tokens("token 300 not UTF-8", lambda items: items[:300] + [b"\xc3("] + items[301:]),
        edit_tokens("10 tokens for a 512-row embedding", lambda items: items[:10]),
        edit_tokens("10 types for 512 tokens", lambda items: items[:10], "tokenizer.ggml.token_type", I32),
        edit_tokens("a merge without a space", lambda items: ["abc"] + items[1:], "tokenizer.ggml.merges"),
        edit_tokens("a merge of unknown tokens", lambda items: ["zzq qqz"] + items[1:], "tokenizer.ggml.merges"),
        edit_tokens("tokens as u32s", lambda items: list(range(len(items))), item_type=U32),
        set_values("gguf-tokenizer", {"tokenizer.ggml.model": (STRING, "nope")}),
        set_values("gguf-tokenizer", {"tokenizer.ggml.tokens": (None, None)}),
        set_values("gguf-tokenizer", {"tokenizer.ggml.merges": (None, None)}),
    ]


def _tensors() -> list[Mutation]:
    return [
        edit_tensors("tensor blk.1.ffn_down.weight dropped",
                     lambda infos: [encode_tensor(t) for t in infos if t.name != "blk.1.ffn_down.weight"]),
        edit_tensors("every tensor dropped", lambda infos: []),
        renamed("blk.0.attn_q.weight", "blk.0.attn_zz.weight"), renamed("blk.0.attn_q.weight", "blk.7.attn_q.weight"),
        renamed("blk.0.attn_k.weight", "blk.0.attn_q.weight"), renamed("blk.0.attn_q.weight", ""),
        renamed("blk.0.attn_q.weight", b"blk.0.\xff"), renamed("blk.0.attn_q.weight", "n" * 300),
        reshaped("blk.0.attn_k.weight", (128, 256)), reshaped("token_embd.weight", (256, 511)),
        reshaped("output_norm.weight", (255,)), reshaped("blk.0.attn_q.weight", (256, 128, 2)),
        reshaped("blk.0.ffn_down.weight", ggml_type=GGML_F32), reshaped("blk.0.attn_q.weight", ggml_type=1),
    ]


def _truncations() -> list[Mutation]:
    cuts = [(str(n), lambda layout, size, n=n: n) for n in (0, 3, 4, 7, 15, 23)]
    cuts += [("the middle of the metadata", lambda layout, size: layout.tensor_infos_at // 2),
             ("the first tensor info", lambda layout, size: layout.tensor_infos_at),
             ("40 bytes into the tensor infos", lambda layout, size: layout.tensor_infos_at + 40),
             ("the data section's start", lambda layout, size: layout.data_at),
             ("the middle of the data", lambda layout, size: size // 2),
             ("the last byte", lambda layout, size: size - 1)]
    return [truncated(shown, at) for shown, at in cuts]


def _weights() -> list[Mutation]:
    return [patched_weight("token_embd.weight", 0, math.nan), patched_weight("blk.0.attn_norm.weight", 8, math.inf),
            patched_weight("output.weight", 4096, math.nan), patched_weight("blk.1.attn_q.weight", 0, -math.inf),
            patched_weight("blk.0.ffn_down.weight", 34, math.nan, "<e", "a Q8_0 block's scale")]


def catalog() -> list[Mutation]:
    return _header() + _config() + _tokenizer() + _tensors() + _truncations() + _weights()


def drawn(rng: random.Random, bases: Bases) -> Mutation:
    """A random mutation: a random header number set to a random extreme, a few random bytes of the header
    overwritten, a random cut, or a random metadata key given a random type and value."""
    layout, choice = read_layout(bases.gguf), rng.randrange(4)
    if choice == 0:
        field = rng.choice(layout.fields)
        value = rng.choice((0, 1, field.value - 1, field.value + 1, 2 * field.value, *HUGE_INTS))
        return set_field(field.name, value)
    if choice == 1:
        at, pattern = rng.randrange(4, layout.data_at), rng.choice((b"\xff" * 8, b"\x00" * 8, b"\x7f\xff\xff\xff",
                                                                   b"\x80", b"\x09", bytes([rng.randrange(256)])))

        def make(bases: Bases, folder: Path) -> str:
            data = bytearray(_base_bytes(bases))
            data[at : at + len(pattern)] = pattern
            return _write(folder, bytes(data))

        return Mutation("gguf-header", f"bytes at {at} overwritten with {pattern.hex()}", "model", make)
    if choice == 2:
        at = rng.randrange(layout.data_at + 64)
        return truncated(str(at), lambda layout, size: at)
    entry = rng.choice([e for e in layout.entries if e.value_type != ARRAY])
    kind, value = rng.choice(((U32, rng.choice(HUGE_INTS[:2])), (U32, 0), (I32, -rng.randrange(1, 2**31)),
                              (F32, rng.choice((math.nan, -math.inf, -1.0, 1e38))), (STRING, "x" * rng.randrange(3)),
                              (BOOL, False), (U64, rng.choice(HUGE_INTS)), (ARRAY, ["1"])))
    return set_values("gguf-config", {entry.key: (kind, value)})
