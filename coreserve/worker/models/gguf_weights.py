"""Reads a GGUF file's weights one tensor at a time under their Hugging Face names, dequantized with the
`gguf` package's own numpy routines (the ones transformers' GGUF loader calls, so the values are the
same bit for bit) and then converted to the destination's dtype (engine-core process).

The same interface as safetensors_files.py (`list_tensors`, `read_into`, `read_tensor`), so the loader
fills parameters from either. Each tensor's bytes are memory-mapped and dequantized a block of rows at
a time straight into the model's parameter (q and k whole, with their permuted copy). llama.cpp
stores the q and k projections of `llama`-architecture files with each head's rows interleaved in
pairs (its RoPE rotates adjacent pairs, HF's rotates halves); they are put back in HF's order here, as
transformers does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from coreserve.protocol.gguf_header import GGUFTensorInfo, read_gguf_header
from coreserve.worker.models.gguf_config import GGUF_ARCHS, gguf_architecture

# ggml type value -> name, for the types loaded (every other is refused by name)
SUPPORTED_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "post_attention_norm": "post_attention_layernorm",  # Gemma's sandwich (its ffn_norm is the pre-MLP norm)
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Per architecture, where a GGUF name means something else than in `llama` (the loader's name map)
_ARCH_LAYER = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused, in that order
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE: config


@dataclass(frozen=True)
class GGUFEntry:
    name: str  # the Hugging Face name (a GGUF name that has none stays as it is)
    info: GGUFTensorInfo
    path: str
    shape: tuple[int, ...]  # torch's order
    num_bytes: int
    interleaved_heads: int | None  # llama-architecture q/k: heads whose rows llama.cpp permuted
    minus_one: bool = False  # Gemma's norms: llama.cpp stores 1 + weight


def list_tensors(path: str) -> Iterator[GGUFEntry]:
    """Every tensor of the file, in file order; an unsupported tensor type is a ValueError naming it."""
    header = read_gguf_header(path)
    arch = gguf_architecture(header)
    rules, meta = GGUF_ARCHS[arch], header.metadata
    heads = {"attn_q": meta.get(f"{arch}.attention.head_count"), "attn_k": meta.get(f"{arch}.attention.head_count_kv")}
    heads["attn_k"] = heads["attn_k"] or heads["attn_q"]
    for info in sorted(header.tensors, key=lambda t: t.offset):
        if info.ggml_type not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {info.name} has GGUF type {_type_name(info.ggml_type)}, which is "
                             f"not supported; supported: {sorted(SUPPORTED_TYPES.values())}")
        if info.name in _CONFIG_TENSORS:
            continue
        name, module = hf_name(info.name, arch)
        interleaved = int(heads[module]) if rules.interleaved_qk and module in heads else None
        if module in _EXPERTS:
            yield from _expert_entries(info, path, name)
            continue
        minus_one = rules.norms_plus_one and name.endswith("norm.weight")
        yield GGUFEntry(name, info, path, tuple(reversed(info.dims)), info.num_bytes, interleaved, minus_one)


def hf_name(gguf_name: str, arch: str = "llama") -> tuple[str, str | None]:
    """The HF tensor name, and the GGUF module name it came from (`attn_q`, ...). An experts tensor
    (`ffn_gate_exps`, all of a layer's experts) gets its layer's prefix, `model.layers.N.mlp.experts`."""
    module, _, kind = gguf_name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{kind}", module
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _EXPERTS:
        return f"model.layers.{parts[1]}.mlp.experts", parts[2]
    layer = {**_LAYER, **_ARCH_LAYER.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{kind}", parts[2]
    return gguf_name, None


def _expert_entries(info: GGUFTensorInfo, path: str, prefix: str) -> Iterator[GGUFEntry]:
    """One entry per expert of a [experts, rows, columns] tensor: each expert's rows are a contiguous
    run of the file, read (or kept in blocks) as any 2-D tensor is, under HF's per-expert name."""
    if len(info.dims) != 3:
        raise ValueError(f"tensor {info.name}: an experts tensor has 3 dimensions, not {len(info.dims)}")
    columns, rows, num_experts = info.dims
    role = _EXPERTS[info.name.split(".")[2]]
    num_bytes = info.num_bytes // num_experts
    for expert in range(num_experts):
        one = GGUFTensorInfo(info.name, info.ggml_type, (columns, rows), info.offset + expert * num_bytes)
        yield GGUFEntry(f"{prefix}.{expert}.{role}.weight", one, path, (rows, columns), num_bytes, None)


def read_into(entry: GGUFEntry, destination: torch.Tensor) -> None:
    """Dequantizes the tensor into `destination` (same number of elements, any dtype and device), a
    block of rows at a time: only one block's fp32 values exist besides the destination."""
    if destination.numel() != int(np.prod(entry.shape)):
        raise ValueError(f"{entry.name}: shape {list(entry.shape)} does not fit {list(destination.shape)}")
    if entry.interleaved_heads is not None or entry.minus_one or not destination.is_contiguous():  # small
        destination.copy_(read_tensor(entry).view(destination.shape))
        return
    rows = _raw_rows(entry)  # [num_rows, bytes per row] uint8
    out = destination.view(rows.shape[0], -1)
    step = max(1, _BLOCK_BYTES // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        out[start : start + step].copy_(torch.from_numpy(_dequantize(rows[start : start + step], entry)))


def read_tensor(entry: GGUFEntry) -> torch.Tensor:
    """The tensor's values in float32 (what dequantization gives), HF's row order, new CPU memory."""
    values = torch.from_numpy(_dequantize(_raw_rows(entry), entry)).reshape(entry.shape)
    if entry.interleaved_heads is not None:
        values = _undo_pair_interleave(values, entry.interleaved_heads)
    return values - 1 if entry.minus_one else values


_BLOCK_BYTES = 4 << 20  # raw bytes dequantized at a time


def _raw_rows(entry: GGUFEntry) -> np.ndarray:
    """The tensor's bytes [num_rows, bytes per row] uint8, memory-mapped from the file (read-only)."""
    num_rows = _num_rows(entry.info)
    try:
        raw = np.memmap(entry.path, dtype=np.uint8, mode="r", offset=entry.info.offset, shape=(entry.num_bytes,))
    except ValueError as exc:  # numpy's words for a region past the end of the file
        raise ValueError(f"{entry.path} is truncated (tensor {entry.info.name})") from exc
    return raw.reshape(num_rows, entry.num_bytes // num_rows)


def _dequantize(rows: np.ndarray, entry: GGUFEntry) -> np.ndarray:
    """[n, bytes per row] raw -> [n, values per row] float32, new memory, with gguf's routine for the
    type applied to all the rows at once (gguf's own `dequantize` calls it 16 rows at a time)."""
    import gguf.quants
    from gguf.constants import GGMLQuantizationType

    kind = GGMLQuantizationType(entry.info.ggml_type)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.array(gguf.quants.dequantize(rows, kind), dtype=np.float32)
    quant = getattr(gguf.quants, kind.name)
    quant.init_grid()
    return np.ascontiguousarray(quant.dequantize_rows(rows), dtype=np.float32)


def _undo_pair_interleave(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head as (dim/2 pairs, 2) -> (2 halves, dim/2): llama.cpp's permutation reversed."""
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def _num_rows(info: GGUFTensorInfo) -> int:
    return int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1


def _type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"#{ggml_type} (unknown)"
