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
}


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
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {model_dir}")
    return files


def list_tensors(model_dir: str) -> Iterator[TensorEntry]:
    """Every tensor of every shard, in file order."""
    for path in checkpoint_files(model_dir):
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        entries = []
        for name, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path.name}: tensor {name} has dtype {info['dtype']}, not supported")
            begin, end = info["data_offsets"]
            entries.append(
                TensorEntry(name, path, _DTYPES[info["dtype"]], tuple(info["shape"]), 8 + header_len + begin,
                            8 + header_len + end)
            )
        yield from sorted(entries, key=lambda e: e.start)


def read_into(entry: TensorEntry, destination: torch.Tensor) -> None:
    """Copies the tensor into `destination` (same number of elements, any dtype and device)."""
    if destination.numel() != _numel(entry.shape):
        raise ValueError(f"{entry.name}: shape {list(entry.shape)} does not fit {list(destination.shape)}")
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
    raw = target.view(-1).view(torch.uint8).numpy()  # the target's own memory, as bytes
    assert raw.nbytes == entry.end - entry.start, entry.name
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
