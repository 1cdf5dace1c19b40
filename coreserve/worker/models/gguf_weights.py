"""Reads a GGUF file's weights one tensor at a time under their Hugging Face names, dequantized with the
`gguf` package's own numpy routines (the ones transformers' GGUF loader calls, so the values are the
same bit for bit) and then converted to the destination's dtype (engine-core process).

The same interface as safetensors_files.py (`list_tensors`, `read_into`, `read_tensor`), so the loader
fills parameters from either. Each tensor's bytes are memory-mapped and dequantized a block of rows at
a time straight into the model's parameter (q and k whole, with their permuted copy). llama.cpp
stores the q and k projections of `llama`-architecture files with each head's rows interleaved in
pairs (its RoPE rotates adjacent pairs, HF's rotates halves); they are put back in HF's order here, as
transformers does. A `qwen35` file's Gated DeltaNet tensors are read back into HF's form as
coreserve/worker/models/gguf_recurrent.py says; a multi-token-prediction head's blocks (the last
`nextn_predict_layers`) are named `mtp.blk.N...`: like a folder's `mtp.` tensors, not the model's. An `lfm2`
file's tensors get LFM2's own HF names (`conv.in_proj`, `feed_forward.w1`, `model.embedding_norm`, ...), its
conv kernel back to nn.Conv1d's [hidden, 1, kernel]. A `granitehybrid` file's Mamba2 tensors get Granite's HF
names (`mamba.in_proj`, `mamba.A_log`, ...), the vectors llama.cpp stored as matrices read back as vectors.
Qwen3-Next's shared expert gate is [1, hidden] as the converter writes it, or [hidden] as llama-quantize
rewrites it (ggml counts no trailing dimension of 1; llama.cpp reads both). A `gpt-oss` file's experts are
stacked with their biases, gate and up apart: read per expert under HF's per-expert names (filling each expert's
[gate | up] halves, as a Mixtral's), its attention sinks as `self_attn.sinks`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from coreserve.protocol.gguf_header import GGUFHeader, GGUFTensorInfo, read_gguf_header
from coreserve.worker.models.gguf_config import GGUF_ARCHS, gguf_architecture, num_draft_layers
from coreserve.worker.models.gguf_recurrent import (
    LINEAR_ATTENTION_NAMES,
    LINEAR_ATTENTION_PARAMS,
    MAMBA2_NAMES,
    MAMBA2_PARAMS,
    SHORT_CONV_NAMES,
    LinearShapes,
    TiledHeads,
    a_log_from_ssm_a,
    attention_kv_heads,
    linear_shapes,
    tiled_heads,
)

# ggml type value -> name, for the types loaded (every other is refused by name)
SUPPORTED_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 39: "MXFP4"}
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
_ARCH_TOP = {"lfm2": {"token_embd_norm": "model.embedding_norm"}}  # LFM2's final norm, despite the GGUF name
_LFM2_LAYER = {
    **SHORT_CONV_NAMES, "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm", "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
}
# Qwen3-Next's: its Gated DeltaNet's (b/a still grouped by key head, as HF's) and its shared expert's
_QWEN3NEXT_LAYER = {
    **LINEAR_ATTENTION_NAMES, "ssm_ba": "linear_attn.in_proj_ba", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Per architecture, where a GGUF name means something else than in `llama` (the loader's name map)
_ARCH_LAYER = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused, in that order
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "qwen35": LINEAR_ATTENTION_NAMES,  # attn_qkv and attn_gate: the Gated DeltaNet's in_proj_qkv, in_proj_z
    "lfm2": _LFM2_LAYER,
    "granitehybrid": MAMBA2_NAMES,
    "qwen3next": _QWEN3NEXT_LAYER,
}
# names after `blk.N.` that are whole HF parameters
_ARCH_PARAMS = {
    "qwen35": LINEAR_ATTENTION_PARAMS, "qwen3next": LINEAR_ATTENTION_PARAMS, "granitehybrid": MAMBA2_PARAMS,
    "gpt-oss": {"attn_sinks.weight": "self_attn.sinks"},  # a logit a head, HF's parameter without `.weight`
}
# Mamba2's [heads, 1] and [groups, inner / groups] (the metadata's group count): HF's vectors; another shape of
# as many values stays as the file says it, for the loader's shape check to refuse, as llama.cpp refuses it
_AS_VECTORS = ("ssm_a", "ssm_d", "ssm_norm")
_PLAIN_NORMS = ("ssm_norm",)  # a norms_plus_one architecture's norms stored as they are
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
    tiled_heads: TiledHeads | None = None  # Qwen3.5's value heads llama.cpp tiled (gguf_recurrent.py)
    is_ssm_a: bool = False  # Qwen3.5's ssm_a = -exp(A_log): read as A_log


def list_tensors(path: str) -> Iterator[GGUFEntry]:
    """Every tensor of the file, in file order; an unsupported tensor type is a ValueError naming it."""
    header = read_gguf_header(path)
    arch = gguf_architecture(header)
    meta, heads = header.metadata, {}
    if GGUF_ARCHS[arch].interleaved_qk:  # the heads whose q/k rows llama.cpp permuted (a count for all layers)
        kv_heads = meta.get(f"{arch}.attention.head_count_kv")
        if not isinstance(kv_heads, int | None):  # one a layer (0: a recurrent layer's): the attention layers'
            kv_heads = attention_kv_heads(header, arch)
        heads = {"attn_q": meta.get(f"{arch}.attention.head_count"), "attn_k": kv_heads}
        heads["attn_k"] = heads["attn_k"] or heads["attn_q"]
    shapes = linear_shapes(header, arch) if GGUF_ARCHS[arch].tiles_value_heads else None
    groups = meta.get(f"{arch}.ssm.group_count")  # the rows of Mamba2's ssm_norm
    first_draft = _first_draft_block(header)
    for info in sorted(header.tensors, key=lambda t: t.offset):
        if _is_draft(info.name, first_draft):  # never read: its type does not matter
            yield GGUFEntry("mtp." + info.name, info, path, tuple(reversed(info.dims)), info.num_bytes, None)
            continue
        if info.ggml_type not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {info.name} has GGUF type {_type_name(info.ggml_type)}, which is "
                             f"not supported; supported: {sorted(SUPPORTED_TYPES.values())}")
        if info.name in _CONFIG_TENSORS:
            continue
        name, module = hf_name(info.name, arch)
        if module in _EXPERTS:
            yield from _expert_entries(info, path, name)
            continue
        yield _entry(info, path, arch, (name, module), heads, shapes, groups)


def file_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's GGUF dimensions by its GGUF name, a multi-token-prediction head's as `mtp.blk.N...`:
    not the model's layers (what the loader's check of the layer count reads)."""
    header = read_gguf_header(path)
    first_draft = _first_draft_block(header)
    return {("mtp." if _is_draft(t.name, first_draft) else "") + t.name: t.dims for t in header.tensors}


def _first_draft_block(header: GGUFHeader) -> int | None:
    """The first block of a multi-token-prediction head (`nextn_predict_layers` blocks at the end)."""
    arch = gguf_architecture(header)
    num_draft = num_draft_layers(header, arch)
    return header.metadata[f"{arch}.block_count"] - num_draft if num_draft else None


def _is_draft(gguf_name: str, first_draft: int | None) -> bool:
    parts = gguf_name.split(".")
    is_block = len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit()
    return first_draft is not None and is_block and int(parts[1]) >= first_draft


def _entry(info: GGUFTensorInfo, path: str, arch: str, names: tuple[str, str | None], heads: dict,
           shapes: LinearShapes | None, groups: object = None) -> GGUFEntry:
    """A tensor's entry under its HF name (and the GGUF module it came from), with what reading it takes."""
    (name, module), rules = names, GGUF_ARCHS[arch]
    interleaved = int(heads[module]) if rules.interleaved_qk and module in heads else None
    minus_one = rules.norms_plus_one and name.endswith("norm.weight") and module not in _PLAIN_NORMS
    shape = tuple(reversed(info.dims))
    if module in ("ssm_conv1d", "shortconv.conv") and len(shape) == 2:  # llama.cpp squeezed [channels, 1, kernel]
        shape = (shape[0], 1, shape[1])
    is_stacked = len(shape) == 2 and (shape[0] == groups if module == "ssm_norm" else shape[1] == 1)
    if module in _AS_VECTORS and is_stacked:
        shape = (shape[0] * shape[1],)
    if module == "ffn_gate_inp_shexp" and len(shape) == 1:  # llama-quantize's [hidden] (ggml drops the 1)
        shape = (1, shape[0])
    tiled = tiled_heads(module, shapes) if shapes is not None and module is not None else None
    return GGUFEntry(name, info, path, shape, info.num_bytes, interleaved, minus_one, tiled, module == "ssm_a")


def hf_name(gguf_name: str, arch: str = "llama") -> tuple[str, str | None]:
    """The HF tensor name, and the GGUF module name it came from (`attn_q`, ...). An experts tensor
    (`ffn_gate_exps`, all of a layer's experts) gets its layer's prefix, `model.layers.N.mlp.experts`."""
    parts = gguf_name.split(".", 2)
    params = _ARCH_PARAMS.get(arch, {})
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in params:
        return f"model.layers.{parts[1]}.{params[parts[2]]}", parts[2].split(".")[0]
    module, _, kind = gguf_name.rpartition(".")
    top = {**_TOP, **_ARCH_TOP.get(arch, {})}
    if module in top:
        return f"{top[module]}.{kind}", module
    parts = module.split(".", 2)  # a layer's module may have a dot itself (`shortconv.in_proj`)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _EXPERTS:
        return f"model.layers.{parts[1]}.mlp.experts", parts[2]
    layer = {**_LAYER, **_ARCH_LAYER.get(arch, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{kind}", parts[2]
    return gguf_name, None


def _expert_entries(info: GGUFTensorInfo, path: str, prefix: str) -> Iterator[GGUFEntry]:
    """One entry per expert of a [experts, rows, columns] weight or an [experts, rows] bias (gpt-oss's): each
    expert's part is a contiguous run of the file, read (or kept in blocks) as any 2-D or 1-D tensor is, under
    HF's per-expert name."""
    kind = info.name.rsplit(".", 1)[1]
    wanted = 2 if kind == "bias" else 3
    if len(info.dims) != wanted:
        raise ValueError(f"tensor {info.name}: an experts {kind} has {wanted} dimensions, not {len(info.dims)}")
    *one_dims, num_experts = info.dims
    role = _EXPERTS[info.name.split(".")[2]]
    num_bytes = info.num_bytes // num_experts
    for expert in range(num_experts):
        one = GGUFTensorInfo(info.name, info.ggml_type, tuple(one_dims), info.offset + expert * num_bytes)
        shape = tuple(reversed(one_dims))
        yield GGUFEntry(f"{prefix}.{expert}.{role}.{kind}", one, path, shape, num_bytes, None)


def read_into(entry: GGUFEntry, destination: torch.Tensor) -> None:
    """Dequantizes the tensor into `destination` (same number of elements, any dtype and device), a
    block of rows at a time: only one block's fp32 values exist besides the destination."""
    if destination.numel() != int(np.prod(entry.shape)):
        raise ValueError(f"{entry.name}: shape {list(entry.shape)} does not fit {list(destination.shape)}")
    is_moved = entry.interleaved_heads is not None or entry.tiled_heads is not None or entry.is_ssm_a
    if is_moved or entry.minus_one or not destination.is_contiguous():  # small, or the whole tensor's rows moved
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
    if entry.tiled_heads is not None:
        values = entry.tiled_heads.undo(values, entry.name)
    if entry.is_ssm_a:
        values = a_log_from_ssm_a(values, entry.name)
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
