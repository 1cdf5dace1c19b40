"""GGUF weights kept in their blocks: which modules of a model stay quantized, and the file's bytes
copied into them (engine-core process).

A linear layer (or the embedding table) stays in its blocks when every GGUF tensor it is filled from
has a type with a product here (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4; coreserve/worker/models/quantized.py) and
its rows are whole blocks (a fused projection of several such types keeps each tensor's rows in its
own); any other (F16, Q2_K, Q3_K, Q5_0, Q5_1) is dequantized to fp32 at load, as with
`dtype="float32"`: the same values either way. Rows move as bytes: llama.cpp's q/k row interleave is
undone on whole rows, as Qwen3.5's tiled value heads (gguf_recurrent.py) are: on whole rows, and on
out_proj's columns where a value head is whole blocks (else that projection is dequantized); tensor
parallelism keeps whole rows (split by output features) or whole blocks of each row (split by input
features) of the rank's part. docs/quantized.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from coreserve.worker.models import gguf_weights
from coreserve.worker.models.quantized import QUANT_TYPES, Parts, can_quantize
from coreserve.worker.models.sharding import Shard, is_split, rank_part

Destination = Callable[[str], "tuple[str, slice | None] | None"]  # HF name -> (parameter, rows)


def quantization_plan(path: str, model: nn.Module, destination: Destination) -> dict[str, int | Parts]:
    """Module path ("layers.0.qkv_proj", "embed_tokens", "lm_head") -> the ggml type it keeps, for the
    modules of `model` (this rank's shapes) that stay in their blocks; a fused linear layer whose GGUF
    tensors differ in type keeps each tensor's rows in its own: its runs, (rows, ggml type) in order."""
    found: dict[str, list[tuple[int, int, int]]] = {}  # module -> (first row, rows, ggml type) a tensor
    moved_apart: set[str] = set()  # modules with columns that move across blocks: dequantized
    for entry in gguf_weights.list_tensors(path):
        target = destination(entry.name)
        if target is None or not target[0].endswith(".weight") or len(entry.shape) != 2:
            continue
        module_path, rows = target[0].removesuffix(".weight"), target[1]
        if entry.tiled_heads is not None and entry.tiled_heads.in_bytes(entry.info.ggml_type) is None:
            moved_apart.add(module_path)
        try:
            module = model.get_submodule(module_path)
        except AttributeError:  # a tensor this config has no place for (an attention layer's linear_attn):
            continue  # the loader refuses it by name
        num_out = module.num_embeddings if isinstance(module, nn.Embedding) else getattr(module, "out_features", 0)
        start, stop, _ = (rows or slice(None)).indices(num_out)
        found.setdefault(module_path, []).append((start, stop - start, entry.info.ggml_type))
    plan: dict[str, int | Parts] = {}
    for module_path, runs in found.items():
        if module_path in moved_apart:
            continue
        module = model.get_submodule(module_path)
        num_in = module.embedding_dim if isinstance(module, nn.Embedding) else getattr(module, "in_features", 0)
        types = {ggml_type for _, _, ggml_type in runs}
        if not isinstance(module, nn.Linear | nn.Embedding) or not all(can_quantize(t, num_in) for t in types):
            continue
        if len(types) == 1:
            plan[module_path] = types.pop()
        elif isinstance(module, nn.Linear) and _tile(sorted(runs), module.out_features):
            plan[module_path] = _merged_runs(sorted(runs))  # else fp32, and the loader names what is missing
    return plan


def _tile(runs: list[tuple[int, int, int]], num_out: int) -> bool:
    """Whether the tensors' rows, in order, cover [0, num_out) once each."""
    end = 0
    for first, rows, _ in runs:
        if first != end:
            return False
        end += rows
    return end == num_out


def _merged_runs(runs: list[tuple[int, int, int]]) -> Parts:
    """(first row, rows, type) tensors in row order -> the runs of one type each, neighbours merged."""
    merged: list[list[int]] = []
    for _, rows, ggml_type in runs:
        if merged and merged[-1][1] == ggml_type:
            merged[-1][0] += rows
        else:
            merged.append([rows, ggml_type])
    return tuple((rows, ggml_type) for rows, ggml_type in merged)


def read_blocks_into(entry: gguf_weights.GGUFEntry, destination: torch.Tensor, shard: Shard | None) -> None:
    """The tensor's blocks (this rank's part under `shard`) into `destination` [rows, row bytes] uint8,
    HF's row order."""
    with warnings.catch_warnings():  # read-only memory-mapped bytes, only ever read: no copy on the heap
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(gguf_weights._raw_rows(entry))  # [rows, row bytes]
    if entry.interleaved_heads is not None:  # whole rows permuted: the values travel with their bytes
        raw = gguf_weights._undo_pair_interleave(raw, entry.interleaved_heads)
    if entry.tiled_heads is not None:  # whole rows, or columns of whole blocks (the plan's condition)
        in_bytes = entry.tiled_heads.in_bytes(entry.info.ggml_type)
        assert in_bytes is not None, entry.name
        raw = in_bytes.undo(raw, entry.name)
    if shard is not None and is_split(entry.name):
        part = rank_part(entry.name, raw, shard)
        block_bytes = QUANT_TYPES[entry.info.ggml_type][1]
        if part.shape[1] != raw.shape[1] and raw.shape[1] % (shard.size * block_bytes):
            raise ValueError(f"{entry.name}: {raw.shape[1] // block_bytes} blocks a row do not split over "
                             f"tensor_parallel_size={shard.size} at block boundaries")
        raw = part
    if raw.shape != destination.shape:
        raise ValueError(f"{entry.name}: shape {list(entry.shape)} does not fit this model's config")
    destination.copy_(raw)
