"""Reads the header of a GGUF file (llama.cpp's checkpoint format): its metadata and its tensors' names,
types, shapes and offsets, without reading any tensor data. Both processes use it: the frontend and the
core fingerprint the tokenizer the file carries; the core builds its config and loads the weights from
it (coreserve/worker/models/gguf_*.py). numpy and the standard library only.

Format (little-endian): b"GGUF", version (u32, 2 or 3), tensor count and metadata count (u64), the
metadata as key (string), value type (u32), value; then per tensor name, number of dimensions (u32),
the dimensions (u64, fastest-varying first), ggml type (u32) and offset (u64) from the data section,
which starts at the next multiple of `general.alignment` (32 when absent).

The file is untrusted input (llama.cpp's parser CVEs): every count, length, size and offset is checked
against the bytes the file has before it drives a read, an allocation or a loop, and each refusal is a
ValueError naming the field.
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
_MAX_ALIGNMENT = 1 << 20
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NAME_BYTES = 256  # llama.cpp's GGML_MAX_NAME is 64; room for other writers
_MAX_NUMEL = 2**63 - 1  # ggml counts elements in int64
_STRING, _ARRAY = 8, 9
# metadata value type -> struct format of one value (8: string and 9: array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U64 = struct.Struct("<Q")
_MIN_ENTRY_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, a 1-byte name, n_dims, one dim, type, offset
# ggml type -> (values a block, bytes a block): gguf's GGML_QUANT_SIZES, every type it names
GGML_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
    22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value, one of GGML_BLOCKS
    dims: tuple[int, ...]  # GGUF's order, fastest-varying first: reversed, it is torch's shape
    offset: int  # byte offset in the file

    @property
    def num_bytes(self) -> int:
        """The tensor's bytes in the file (its rows are whole blocks: the reader checked)."""
        block_size, block_bytes = GGML_BLOCKS[self.ggml_type]
        num_rows = 1
        for size in self.dims[1:]:
            num_rows *= size
        return self.dims[0] // block_size * block_bytes * num_rows


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
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path} is not a GGUF file (it is empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Parser(data, path).header()


def _alignment(metadata: dict[str, object], path: str) -> int:
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or not 0 < alignment <= _MAX_ALIGNMENT or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment={alignment!r:.100} is not a power of two up to "
                         f"{_MAX_ALIGNMENT}")
    return alignment


class _Parser:
    def __init__(self, data: mmap.mmap | bytes, path: str) -> None:
        self.data, self.path, self.pos = data, path, 0

    def header(self) -> GGUFHeader:
        if self.data[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
        self.pos = 4
        (version,) = self.unpack("I", "version")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        num_tensors, num_entries = self.unpack("QQ", "tensor and metadata counts")
        self.check_count(num_entries, _MIN_ENTRY_BYTES, "metadata count")
        self.check_count(num_tensors, _MIN_TENSOR_BYTES, "tensor count")
        metadata, digest = self.metadata(num_entries)
        alignment = _alignment(metadata, self.path)
        infos = [self.tensor_info(index, alignment) for index in range(num_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        tensors = [GGUFTensorInfo(n, t, d, data_start + o) for n, t, d, o in infos]
        self.check_tensors(tensors)
        return GGUFHeader(self.path, version, metadata, tensors, digest)

    def fail(self, field: str, problem: str) -> ValueError:
        return ValueError(f"{self.path}: {field} {problem}")

    def need(self, num_bytes: int, field: str) -> None:
        if num_bytes > len(self.data) - self.pos:
            left = len(self.data) - self.pos
            raise self.fail(field, f"needs {num_bytes} bytes at offset {self.pos}, past the end of the "
                                   f"file ({left} bytes left): a truncated or malformed GGUF header")

    def check_count(self, count: int, min_bytes: int, field: str) -> None:
        if count > (len(self.data) - self.pos) // min_bytes:
            raise self.fail(field, f"{count} is more than a file of {len(self.data)} bytes can hold "
                                   f"({min_bytes} bytes each at least)")

    def unpack(self, fmt: str, field: str) -> tuple:
        self.need(struct.calcsize("<" + fmt), field)
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self, field: str) -> str:
        (length,) = self.unpack("Q", f"{field} length")
        self.need(length, field)
        try:
            text = self.data[self.pos : self.pos + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(field, f"is not UTF-8 ({exc})") from exc
        self.pos += length
        return text

    def metadata(self, num_entries: int) -> tuple[dict[str, object], str]:
        """The entries, and the digest of the raw bytes of the `tokenizer.*` ones."""
        metadata, digest = {}, hashlib.sha256()
        for index in range(num_entries):
            start = self.pos
            key = self.string(f"metadata key #{index}")
            field = f"metadata {key!r:.100}"
            if key in metadata:
                raise self.fail(field, "appears twice")
            (value_type,) = self.unpack("I", f"{field} value type")
            metadata[key] = self.value(value_type, field)
            if key.startswith("tokenizer."):
                digest.update(self.data[start : self.pos])
        return metadata, digest.hexdigest()[:32]

    def value(self, value_type: int, field: str) -> object:
        if value_type == _STRING:
            return self.string(field)
        if value_type == _ARRAY:
            item_type, count = self.unpack("IQ", f"{field} array type and count")
            return self.array(item_type, count, field)
        if value_type not in _SCALARS:
            raise self.fail(field, f"has unknown GGUF metadata value type {value_type}")
        return self.unpack(_SCALARS[value_type], field)[0]

    def array(self, item_type: int, count: int, field: str) -> np.ndarray | list[str]:
        if item_type in _SCALARS:  # numbers in one go: token types and scores have one per token
            dtype = np.dtype("<" + _SCALARS[item_type])
            self.need(dtype.itemsize * count, f"{field} (an array of {count} values)")
            values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += dtype.itemsize * count
            return values
        if item_type == _STRING:  # the vocabulary and merges: 10^5 of them, so one tight loop
            self.check_count(count, 8, f"{field} array count")
            return self.strings(count, field)
        if item_type == _ARRAY:
            raise self.fail(field, "is an array of arrays, which this reader refuses (no model file has one)")
        raise self.fail(field, f"is an array of unknown GGUF metadata value type {item_type}")

    def strings(self, count: int, field: str) -> list[str]:
        data, pos, end, texts, length_of = self.data, self.pos, len(self.data), [], _U64.unpack_from
        index = 0
        try:
            for index in range(count):
                (length,) = length_of(data, pos)
                pos += 8 + length
                if pos > end:
                    raise self.fail(f"{field}[{index}]", f"(a string of {length} bytes) runs past the end "
                                                         f"of the file: a truncated or malformed GGUF header")
                texts.append(data[pos - length : pos].decode("utf-8"))
        except struct.error as exc:
            raise self.fail(f"{field}[{index}]", "runs past the end of the file: a truncated header") from exc
        except UnicodeDecodeError as exc:
            raise self.fail(f"{field}[{index}]", f"is not UTF-8 ({exc})") from exc
        self.pos = pos
        return texts

    def tensor_info(self, index: int, alignment: int) -> tuple[str, int, tuple[int, ...], int]:
        name = self.string(f"tensor #{index} name")
        if not 0 < len(name.encode()) <= _MAX_NAME_BYTES:
            problem = f"is empty or over {_MAX_NAME_BYTES} bytes"
            raise self.fail(f"tensor #{index} name {name[:80]!r}", problem)
        (num_dims,) = self.unpack("I", f"tensor {name!r} n_dims")
        if not 0 < num_dims <= _MAX_DIMS:
            raise self.fail(f"tensor {name!r} n_dims", f"is {num_dims}, not 1 to {_MAX_DIMS}")
        dims = self.unpack("Q" * num_dims, f"tensor {name!r} dims")
        ggml_type, offset = self.unpack("IQ", f"tensor {name!r} ggml type and offset")
        _check_shape(name, dims, ggml_type, self.path)
        if offset % alignment:
            problem = f"{offset} is not a multiple of general.alignment={alignment}"
            raise self.fail(f"tensor {name!r} offset", problem)
        return name, ggml_type, dims, offset

    def check_tensors(self, tensors: list[GGUFTensorInfo]) -> None:
        names = set()
        for info in tensors:
            if info.name in names:
                raise self.fail(f"tensor name {info.name!r}", "appears twice")
            names.add(info.name)
            if info.offset + info.num_bytes > len(self.data):
                problem = f"{info.offset} + {info.num_bytes} bytes is past the file's end ({len(self.data)})"
                raise self.fail(f"tensor {info.name!r} offset", problem)


def _check_shape(name: str, dims: tuple[int, ...], ggml_type: int, path: str) -> None:
    if ggml_type not in GGML_BLOCKS:
        raise ValueError(f"{path}: tensor {name!r} ggml type {ggml_type} is not a known GGUF tensor type")
    numel = 1
    for size in dims:
        if size == 0:
            raise ValueError(f"{path}: tensor {name!r} dims {list(dims)} have a zero dimension")
        numel *= size
    if numel > _MAX_NUMEL:
        raise ValueError(f"{path}: tensor {name!r} dims {list(dims)} have more than 2^63 - 1 elements")
    block_size = GGML_BLOCKS[ggml_type][0]
    if dims[0] % block_size:
        raise ValueError(f"{path}: tensor {name!r} dims: rows of {dims[0]} values are not whole "
                         f"{block_size}-value blocks of ggml type {ggml_type}")
