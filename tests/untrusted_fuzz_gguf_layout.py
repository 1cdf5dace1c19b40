"""A valid GGUF file taken apart for the fuzzer (tests/untrusted_fuzz_gguf.py): its metadata entries and
tensor infos as raw bytes, its data section, and every number of its header with the byte offset it sits
at; and the encoders that put a file back together from edited parts (the data section realigned, so an
edit changes only what it means to).

This walker reads only files the `gguf` package wrote (the fuzzer's bases): it trusts them, and shares
nothing with coreserve/protocol/gguf_header.py, the reader under test.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q",
                  I64: "q", F64: "d"}
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8


@dataclass(frozen=True)
class Field:
    """One number of the header: where it is and its width in bytes (4 or 8)."""

    name: str  # "tensor count", "'llama.block_count' value", "'blk.0.attn_q.weight' dims[1]", ...
    at: int
    width: int
    value: int


@dataclass(frozen=True)
class Entry:
    key: str
    value_type: int
    value: object  # an int, float, bool, str, or a list of those (an array's items)
    item_type: int | None  # an array's


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF's order, fastest-varying first
    ggml_type: int
    offset: int  # from the data section's start


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    tensors: tuple[TensorInfo, ...]
    fields: tuple[Field, ...]
    tensor_infos_at: int  # where the first tensor info starts
    data_at: int  # where the data section starts
    data: bytes  # the data section

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def entry(self, key: str) -> Entry:
        return next(e for e in self.entries if e.key == key)

    def tensor(self, name: str) -> TensorInfo:
        return next(t for t in self.tensors if t.name == name)


@functools.cache
def read_layout(path: str) -> Layout:
    return _Walker(open(path, "rb").read()).layout()


class _Walker:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.fields = data, 4, []

    def number(self, fmt: str, name: str | None) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        if name is not None:
            self.fields.append(Field(name, self.pos, struct.calcsize(fmt), int(value)))
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, name: str | None) -> str:
        length = self.number("Q", name)
        self.pos += length
        return self.data[self.pos - length : self.pos].decode()

    def value(self, value_type: int, name: str | None) -> object:
        if value_type == STRING:
            return self.string(name and f"{name} length")
        fmt = SCALAR_FORMATS[value_type]
        return self.number(fmt, name if fmt in "IiQq" else None)  # the 4- and 8-byte integers are fields

    def layout(self) -> Layout:
        self.number("I", "version")
        num_tensors, num_entries = self.number("Q", "tensor count"), self.number("Q", "metadata count")
        entries = [self.entry() for _ in range(num_entries)]
        tensor_infos_at = self.pos
        tensors = [self.tensor_info() for _ in range(num_tensors)]
        data_at = -(-self.pos // 32) * 32  # the base files keep the default alignment
        return Layout(tuple(entries), tuple(tensors), tuple(self.fields), tensor_infos_at, data_at,
                      self.data[data_at:])

    def entry(self) -> Entry:
        start = self.pos
        key = self.string(None)
        self.fields.append(Field(f"'{key}' key length", start, 8, len(key.encode())))
        value_type = self.number("I", f"'{key}' value type")
        if value_type != ARRAY:
            return Entry(key, value_type, self.value(value_type, f"'{key}' value"), None)
        item_type = self.number("I", f"'{key}' item type")
        count = self.number("Q", f"'{key}' count")
        items = [self.value(item_type, f"'{key}'[0]" if i == 0 else None) for i in range(count)]
        return Entry(key, ARRAY, items, item_type)

    def tensor_info(self) -> TensorInfo:
        start = self.pos
        name = self.string(None)
        self.fields.append(Field(f"'{name}' name length", start, 8, len(name.encode())))
        n_dims = self.number("I", f"'{name}' n_dims")
        dims = tuple(self.number("Q", f"'{name}' dims[{i}]") for i in range(n_dims))
        ggml_type = self.number("I", f"'{name}' ggml type")
        return TensorInfo(name, dims, ggml_type, self.number("Q", f"'{name}' offset"))


def encode_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def encode_value(value_type: int, value: object, item_type: int | None = None) -> bytes:
    if value_type == STRING:
        return encode_string(value)
    if value_type == ARRAY:
        items = list(value)
        if item_type == ARRAY:  # items are (item type, items) pairs
            body = b"".join(encode_value(ARRAY, inner, inner_type) for inner_type, inner in items)
        else:
            body = b"".join(encode_value(item_type, item) for item in items)
        return struct.pack("<IQ", item_type, len(items)) + body
    return struct.pack("<" + SCALAR_FORMATS[value_type], value)


def encode_entry(key: str | bytes, value_type: int, value: object, item_type: int | None = None) -> bytes:
    return encode_string(key) + struct.pack("<I", value_type) + encode_value(value_type, value, item_type)


def encode_entries(entries: list[Entry]) -> list[bytes]:
    return [encode_entry(e.key, e.value_type, e.value, e.item_type) for e in entries]


def encode_tensor(info: TensorInfo, name: str | bytes | None = None) -> bytes:
    head = encode_string(info.name if name is None else name)
    return head + struct.pack(f"<I{len(info.dims)}QIQ", len(info.dims), *info.dims, info.ggml_type, info.offset)


def assemble(entries: list[bytes], tensors: list[bytes], data: bytes, alignment: int = 32,
             counts: tuple[int, int] | None = None, version: int = 3) -> bytes:
    """A GGUF file of these parts; its data section starts at the next multiple of `alignment` (as a reader
    that believes a mutated `general.alignment` looks for it); `counts` (tensors, entries) when they lie."""
    num_tensors, num_entries = counts or (len(tensors), len(entries))
    head = b"GGUF" + struct.pack("<IQQ", version, num_tensors, num_entries) + b"".join(entries) + b"".join(tensors)
    return head + bytes(-len(head) % max(alignment, 1)) + data
