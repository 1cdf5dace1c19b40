"""Reads the header of a GGUF file (llama.cpp's checkpoint format): its metadata and its tensors' names,
types, shapes and offsets, without reading any tensor data. Both processes use it: the frontend and the
core fingerprint the tokenizer the file carries; the core builds its config and loads the weights from
it (worker/models/gguf_*.py). numpy and the standard library only.

Format (little-endian): b"GGUF", version (u32, 2 or 3), tensor count and metadata count (u64), the
metadata as key (string), value type (u32), value; then per tensor name, number of dimensions (u32),
the dimensions (u64, fastest-varying first), ggml type (u32) and offset (u64) from the data section,
which starts at the next multiple of `general.alignment` (32 when absent).
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# metadata value type -> struct format of one value (8: string and 9: array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value
    dims: tuple[int, ...]  # GGUF's order, fastest-varying first: reversed, it is torch's shape
    offset: int  # byte offset in the file


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, object]  # key -> int, float, bool, str, or a list / numpy array of those
    tensors: list[GGUFTensorInfo]
    tokenizer_digest: str  # sha256 of the raw bytes of every `tokenizer.*` metadata entry


def is_gguf(path: str) -> bool:
    return str(path).endswith(".gguf")


def read_gguf_header(path: str) -> GGUFHeader:
    """The header of `path`; a ValueError when it is not a GGUF file this reader understands. Read once
    per process while the file stays the same (the config, the weights, the tokenizer's facts all ask)."""
    try:
        stat = os.stat(path)
    except OSError:
        return _read_header(str(path), -1, -1)  # open() names the problem
    return _read_header(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _Parser(data, str(path)).header()
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: a truncated or malformed GGUF header ({exc})") from exc


class _Parser:
    def __init__(self, data: mmap.mmap, path: str) -> None:
        self.data, self.path, self.pos = data, path, 0

    def header(self) -> GGUFHeader:
        if self.data[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
        self.pos = 4
        (version,) = self.unpack("I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        num_tensors, num_entries = self.unpack("QQ")
        metadata, digest = {}, hashlib.sha256()
        for _ in range(num_entries):
            start = self.pos
            key = self.string()
            (value_type,) = self.unpack("I")
            metadata[key] = self.value(value_type)
            if key.startswith("tokenizer."):
                digest.update(self.data[start : self.pos])
        infos = [self.tensor_info() for _ in range(num_tensors)]
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self.pos // alignment) * alignment
        tensors = [GGUFTensorInfo(n, t, d, data_start + o) for n, t, d, o in infos]
        return GGUFHeader(self.path, version, metadata, tensors, digest.hexdigest()[:32])

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        text = self.data[self.pos : self.pos + length].decode("utf-8")
        self.pos += length
        return text

    def value(self, value_type: int) -> object:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("IQ")
            return self.array(item_type, count)
        if value_type not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type}")
        return self.unpack(_SCALARS[value_type])[0]

    def array(self, item_type: int, count: int) -> list | np.ndarray:
        if item_type in _SCALARS:  # numbers in one go: token types and scores have one per token
            dtype = np.dtype("<" + _SCALARS[item_type])
            values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += dtype.itemsize * count
            return values
        if item_type == _STRING:  # the vocabulary and merges: 10^5 of them, so one tight loop
            return self.strings(count)
        return [self.value(item_type) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        data, pos, texts, length_of = self.data, self.pos, [], _U64.unpack_from
        for _ in range(count):
            (length,) = length_of(data, pos)
            texts.append(data[pos + 8 : pos + 8 + length].decode("utf-8"))
            pos += 8 + length
        self.pos = pos
        return texts

    def tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self.string()
        (num_dims,) = self.unpack("I")
        dims = self.unpack("Q" * num_dims)
        ggml_type, offset = self.unpack("IQ")
        return name, ggml_type, tuple(dims), offset
