"""Reads a Hugging Face folder's safetensors weights one tensor at a time, straight into a destination
tensor (engine-core process).

One file or several (`model.safetensors.index.json`). The file is read with plain `readinto`, not
memory-mapped: a tensor whose dtype is the destination's goes into the destination's own memory, any
other through one temporary buffer of that tensor alone, so loading holds the model and at most one
checkpoint tensor (a mapped file would add the pages it touched to the process's memory).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,  # gpt-oss's MXFP4 experts (mxfp4_experts.py); a float weight refuses it (read_into)
}
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE); an index is held to it too
_MAX_DIMS = 8  # no checkpoint has more; a shape of a million ones would pass the byte-count check


@dataclass(frozen=True)
class TensorEntry:
    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    end: int


def checkpoint_files(model_dir: str) -> list[Path]:
    """The shards the index names, or every .safetensors file of the folder."""
    folder = Path(model_dir)
    index = folder / INDEX_NAME
    if index.exists():
        return [_shard_path(folder, name) for name in sorted(set(_weight_map(index).values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir}")
    return files


def list_tensors(model_dir: str) -> Iterator[TensorEntry]:
    """Every tensor of every shard, in file order."""
    for path in checkpoint_files(model_dir):
        yield from read_header(path)


def read_header(path: Path) -> list[TensorEntry]:
    """The file's tensors in file order, each checked against the file (an untrusted header: every
    length, shape and offset before it is used); a ValueError naming the field otherwise."""
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path.name} is not a safetensors file: {file_size} bytes, no header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(f"{path.name}: header length {header_len} is past the end of the file "
                             f"({file_size} bytes) or over safetensors' limit of {_MAX_HEADER_BYTES}")
        header = _json_object(f.read(header_len), f"{path.name}'s header")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{path.name}: __metadata__ is not a JSON object")
    data_start, data_size = 8 + header_len, file_size - 8 - header_len
    entries = sorted((_entry(path, name, info, data_start, data_size) for name, info in header.items()),
                     key=lambda e: (e.start, e.end))
    for before, after in zip(entries, entries[1:]):
        if after.start < before.end:
            raise ValueError(f"{path.name}: tensor {after.name}: data_offsets overlap tensor {before.name}")
    return entries


def read_into(entry: TensorEntry, destination: torch.Tensor) -> None:
    """Copies the tensor into `destination` (same number of elements, any dtype and device)."""
    if destination.numel() != _numel(entry.shape):
        raise ValueError(f"{entry.name}: shape {list(entry.shape)} does not fit {list(destination.shape)}")
    if destination.is_floating_point() and not entry.dtype.is_floating_point:  # integers would load as garbage
        raise ValueError(f"{entry.name}: dtype {entry.dtype} is not a floating-point type, as this weight's must be")
    direct = destination.device.type == "cpu" and destination.dtype == entry.dtype
    if direct and destination.is_contiguous():
        _read_bytes(entry, destination)
        return
    buffer = torch.empty(entry.shape, dtype=entry.dtype)
    _read_bytes(entry, buffer)
    destination.copy_(buffer.view(destination.shape))  # converts the dtype and moves to the device


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """The whole tensor in its own dtype, in new memory on the CPU."""
    tensor = torch.empty(entry.shape, dtype=entry.dtype)
    _read_bytes(entry, tensor)
    return tensor


def _read_bytes(entry: TensorEntry, target: torch.Tensor) -> None:
    raw = target.view(-1).view(torch.uint8).numpy()  # the target's own memory, as bytes: end - start of them
    with entry.path.open("rb", buffering=0) as f:
        f.seek(entry.start)
        view, done = memoryview(raw), 0
        while done < raw.nbytes:
            num = f.readinto(view[done:])
            if not num:
                raise ValueError(f"{entry.path.name} is truncated (tensor {entry.name})")
            done += num


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _json_object(raw: bytes, what: str) -> dict:
    """`raw` as a JSON object whose keys appear once each."""
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 ({exc})") from exc
    except (ValueError, RecursionError) as exc:  # a JSONDecodeError, a repeated key, a 10^5-digit number
        raise ValueError(f"{what} is not valid JSON ({str(exc)[:200]})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    value = {}
    for key, item in pairs:
        if key in value:
            raise ValueError(f"the key {key[:100]!r} appears twice")
        value[key] = item
    return value


def _entry(path: Path, name: str, info: object, data_start: int, data_size: int) -> TensorEntry:
    where = f"{path.name}: tensor {name[:200]}"
    if not isinstance(info, dict):
        raise ValueError(f"{where}: its header entry is not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"{where} has dtype {str(dtype)[:50]}, not supported (supported: {sorted(_DTYPES)})")
    if not _is_int_list(shape, _MAX_DIMS):
        raise ValueError(f"{where}: shape {str(shape)[:100]} is not a list of at most {_MAX_DIMS} "
                         f"non-negative integers")
    if not _is_int_list(offsets, 2) or len(offsets) != 2 or not offsets[0] <= offsets[1] <= data_size:
        raise ValueError(f"{where}: data_offsets {str(offsets)[:100]} are not [begin, end] with "
                         f"begin <= end <= {data_size}, the bytes after the header")
    begin, end = offsets
    num_bytes = _numel(tuple(shape)) * _DTYPES[dtype].itemsize
    if num_bytes != end - begin:
        raise ValueError(f"{where}: shape {shape} of {dtype} takes {num_bytes} bytes, but data_offsets "
                         f"{offsets} hold {end - begin}")
    return TensorEntry(name, path, _DTYPES[dtype], tuple(shape), data_start + begin, data_start + end)


def _is_int_list(value: object, max_len: int) -> bool:
    """A JSON list of at most `max_len` non-negative integers (a bool is not one)."""
    return isinstance(value, list) and len(value) <= max_len and all(type(i) is int and i >= 0 for i in value)


def _weight_map(index: Path) -> dict[str, str]:
    if index.stat().st_size > _MAX_HEADER_BYTES:
        raise ValueError(f"{index.name} is over {_MAX_HEADER_BYTES} bytes: not a safetensors index")
    weight_map = _json_object(index.read_bytes(), index.name).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index.name}: weight_map is not a non-empty JSON object")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ValueError(f"{index.name}: weight_map[{name[:200]!r}] is not a file name (a string)")
    return weight_map


def _shard_path(folder: Path, name: str) -> Path:
    """The shard `name` in `folder`: a file name, never a path that leaves it (absolute, `..`, or
    through a sub-folder that may be a link elsewhere). The file itself may be a link: the hub cache
    links every file of a snapshot to its blob, and model folders are often made of links."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{INDEX_NAME}: weight_map names the shard {name[:200]!r}, which is not a file name "
                         f"in the model folder")
    path = folder / name
    if not path.is_file():
        raise ValueError(f"{INDEX_NAME}: weight_map names the shard {name[:200]!r}, which is not in {folder}")
    return path
