"""GGUF weights kept in their blocks: which modules of a model stay quantized, and the file's bytes
copied into them (engine-core process).

A linear layer (or the embedding table) stays in its blocks when every GGUF tensor it is filled from
has one type with a product here (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; worker/models/quantized.py) and
its rows are whole blocks; any other (F16, Q2_K, Q3_K, Q5_0, Q5_1, a fused projection of mixed types) is
dequantized to fp32 at load, as with `dtype="float32"`: the same values either way. Rows move as bytes: llama.cpp's q/k row
interleave is undone on whole rows, tensor parallelism keeps whole rows (split by output features) or
whole blocks of each row (split by input features) of the rank's part. docs/quantized.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from worker.models import gguf_weights
from worker.models.quantized import QUANT_TYPES, can_quantize
from worker.parallel.sharding import Shard, is_split, rank_part

Destination = Callable[[str], "tuple[str, slice | None] | None"]  # HF name -> (parameter, rows)


def quantization_plan(path: str, model: nn.Module, destination: Destination) -> dict[str, int]:
    """Module path ("layers.0.qkv_proj", "embed_tokens", "lm_head") -> the ggml type it keeps, for the
    modules of `model` (this rank's shapes) that stay in their blocks."""
    types: dict[str, set[int]] = {}
    for entry in gguf_weights.list_tensors(path):
        target = destination(entry.name)
        if target is None or not target[0].endswith(".weight") or len(entry.shape) != 2:
            continue
        types.setdefault(target[0].removesuffix(".weight"), set()).add(entry.info.ggml_type)
    plan = {}
    for module_path, found in types.items():
        module = model.get_submodule(module_path)
        num_in = module.embedding_dim if isinstance(module, nn.Embedding) else getattr(module, "in_features", 0)
        (ggml_type,) = found if len(found) == 1 else (0,)
        if isinstance(module, nn.Linear | nn.Embedding) and can_quantize(ggml_type, num_in):
            plan[module_path] = ggml_type
    return plan


def read_blocks_into(entry: gguf_weights.GGUFEntry, destination: torch.Tensor, shard: Shard | None) -> None:
    """The tensor's blocks (this rank's part under `shard`) into `destination` [rows, row bytes] uint8,
    HF's row order."""
    with warnings.catch_warnings():  # read-only memory-mapped bytes, only ever read: no copy on the heap
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(gguf_weights._raw_rows(entry))  # [rows, row bytes]
    if entry.interleaved_heads is not None:  # whole rows permuted: the values travel with their bytes
        raw = gguf_weights._undo_pair_interleave(raw, entry.interleaved_heads)
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
