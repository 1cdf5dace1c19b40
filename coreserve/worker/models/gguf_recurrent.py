"""The recurrent layers of a GGUF file read as their Hugging Face form (engine-core process): Qwen3.5's Gated
DeltaNet layers in a `qwen35` file (the `ssm.*` metadata as config.json's linear_* keys and layer kinds, and what
each tensor llama.cpp wrote differs in from HF's), and LFM2's short convolution layers in an `lfm2` file.

llama.cpp's converter stores A_log as `ssm_a` = -exp(A_log) (read back as log(-ssm_a)), dt_bias as
`ssm_dt.bias`, and conv1d's kernel squeezed to [channels, kernel]. Where a key head serves several value
heads it also moves the value heads from HF's grouped order (a key head's value heads side by side) to a
tiled one (value head 0 of every key head, then value head 1 of every key head, ...): the rows of
in_proj_qkv's v part, of in_proj_z, in_proj_b and in_proj_a, the entries of A_log and dt_bias, conv1d's v
channels and out_proj's columns. `TiledHeads.undo` puts them back, on values or on a quantized tensor's
bytes: rows move whole; out_proj's columns move as bytes only where a value head is whole blocks
(`in_bytes`), else that tensor is dequantized (coreserve/worker/models/gguf_quantized.py).

llama.cpp marks LFM2's conv layers by a KV head count of 0 in `attention.head_count_kv`, one count a layer
(read back as layer_types, the attention layers' one count as num_key_value_heads), keeps the kernel's length
as `shortconv.l_cache` (conv_L_cache), squeezes the conv's kernel to [hidden, kernel] as Qwen3.5's conv1d, and
writes as `feed_forward_length` the MLP's real width, already auto-adjusted (so block_auto_adjust_ff_dim is
false).

Granite 4.0-H's Mamba2 layers (`granitehybrid`) are marked as LFM2's conv layers; the `ssm.*` keys give the
mamba_* keys (`time_step_rank` the heads, `inner_size` their width, `group_count`, `state_size`,
`conv_kernel`); `ssm_a` is -exp(A_log) [heads, 1], `ssm_d` D [heads, 1], `ssm_norm` the gated norm's weight
[groups, inner / groups] (read back as vectors), `ssm_dt.bias` dt_bias; the multipliers are `attention.scale`,
`embedding_scale`, `residual_scale` and `logit_scale`; the shared MLP's width `expert_shared_feed_forward_length`
(`feed_forward_length` is the experts'); RoPE only where `rope.scaling.finetuned` (llama.cpp's NoPE switch),
and then on whole heads (`rope.dimension_count` the head size).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from coreserve.protocol.gguf_header import GGML_BLOCKS, GGUFHeader
from coreserve.worker.models.family import CONV, FULL, LINEAR

# GGUF module -> the HF name under model.layers.N (ssm_a and ssm_dt.bias are whole names, no .weight)
LINEAR_ATTENTION_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",  # HF's gated norm: its weight as it is, not 1 + weight
    "ssm_out": "linear_attn.out_proj",
}
LINEAR_ATTENTION_PARAMS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
# LFM2's short convolution: GGUF module -> the HF name under model.layers.N
SHORT_CONV_NAMES = {
    "shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv", "shortconv.out_proj": "conv.out_proj",
}
# Granite 4.0-H's Mamba2: GGUF module -> the HF name under model.layers.N, and its whole parameters
MAMBA2_NAMES = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
                "ssm_out": "mamba.out_proj"}
MAMBA2_PARAMS = {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"}
# GGUF keys of Granite's multipliers -> config.json's
_MULTIPLIERS = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
_MAX_KV_HEADS = 1 << 10


class LinearShapes(NamedTuple):
    num_key_heads: int  # ssm.group_count
    num_value_heads: int  # ssm.time_step_rank
    key_head_dim: int  # ssm.state_size
    value_head_dim: int  # ssm.inner_size / the value heads
    conv_kernel: int  # ssm.conv_kernel


def linear_shapes(header: GGUFHeader, arch: str) -> LinearShapes:
    """The Gated DeltaNet's shapes from the metadata, each checked to be a positive integer."""
    def number(key: str) -> int:
        return _positive_int(header, f"{arch}.{key}")

    num_value_heads, value_width = number("ssm.time_step_rank"), number("ssm.inner_size")
    if value_width % num_value_heads:
        raise ValueError(f"{header.path}: GGUF key {arch}.ssm.inner_size={value_width} is not a multiple of "
                         f"{arch}.ssm.time_step_rank={num_value_heads} value heads")
    return LinearShapes(number("ssm.group_count"), num_value_heads, number("ssm.state_size"),
                        value_width // num_value_heads, number("ssm.conv_kernel"))


def _positive_int(header: GGUFHeader, key: str) -> int:
    value = header.metadata.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 24:
        raise ValueError(f"{header.path}: GGUF key {key}={value!r} must be a positive integer")
    return value


def linear_attention_keys(header: GGUFHeader, arch: str, config: dict) -> dict:
    """config.json's linear_* keys, layer_types and the attention's rotary fraction (`config`: the keys
    read so far, the head size and layer count among them)."""
    meta, shapes = header.metadata, linear_shapes(header, arch)
    keys = dict(
        linear_num_key_heads=shapes.num_key_heads, linear_num_value_heads=shapes.num_value_heads,
        linear_key_head_dim=shapes.key_head_dim, linear_value_head_dim=shapes.value_head_dim,
        linear_conv_kernel_dim=shapes.conv_kernel,
        layer_types=_layer_kinds(header, arch, config["num_hidden_layers"]),
    )
    head_dim = _head_dim(config)
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{header.path}: GGUF key {arch}.attention.value_length differs from the key length "
                         f"{head_dim}, which a Qwen3.5 attention layer shares")
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    factor = rotary / head_dim if isinstance(rotary, int) and not isinstance(rotary, bool) else None
    if factor is None or not 0 < rotary <= head_dim or int(head_dim * factor) != rotary:
        raise ValueError(f"{header.path}: GGUF key {arch}.rope.dimension_count={rotary!r} must be an integer in "
                         f"1..{head_dim} (the head size)")
    # rope.dimension_sections (Qwen3.5's interleaved multimodal RoPE) is not read: a text prompt's
    # positions are the same in every section, which makes it plain RoPE on the rotated part
    keys["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": factor}
    return keys


def _layer_kinds(header: GGUFHeader, arch: str, num_layers: int) -> list[str]:
    """Each layer's kind: `attention.recurrent_layers` (a flag a block, a draft head's included), else a
    full-attention layer every `full_attention_interval` (4 where absent), as llama.cpp reads them."""
    flags = header.metadata.get(f"{arch}.attention.recurrent_layers")
    if flags is None:
        interval = header.metadata.get(f"{arch}.full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{header.path}: GGUF key {arch}.full_attention_interval={interval!r} must be a "
                             "positive integer")
        flags = [(i + 1) % interval != 0 for i in range(num_layers)]
    is_flags = isinstance(flags, np.ndarray | list) and all(isinstance(f, bool | np.bool_) for f in flags)
    if not is_flags or len(flags) < num_layers:
        raise ValueError(f"{header.path}: GGUF key {arch}.attention.recurrent_layers must hold a true/false flag "
                         f"for each of the {num_layers} layers")
    return [LINEAR if flag else FULL for flag in list(flags)[:num_layers]]


@dataclass(frozen=True)
class TiledHeads:
    """Value heads llama.cpp tiled along one dimension of a tensor, from `start` to its end."""

    dim: int  # 0: rows (or a vector's entries); 1: columns
    start: int  # rows (columns) before them: in_proj_qkv's q and k, conv1d's q and k channels
    num_key_heads: int
    num_per_key: int  # value heads a key head serves
    head_size: int  # rows (columns) a value head

    def undo(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """`tensor` (values or bytes) with the heads back in HF's grouped order, new memory."""
        run = self.num_key_heads * self.num_per_key * self.head_size
        if tensor.dim() <= self.dim or tensor.shape[self.dim] != self.start + run:
            num_heads = self.num_key_heads * self.num_per_key
            raise ValueError(f"{name}: shape {list(tensor.shape)} does not hold {num_heads} value heads of "
                             f"{self.head_size} after {self.start} along dimension {self.dim}")
        kept, tiled = tensor.split([self.start, run], dim=self.dim)
        shape, d = tiled.shape, self.dim
        split = (*shape[:d], self.num_per_key, self.num_key_heads, self.head_size, *shape[d + 1 :])
        grouped = tiled.reshape(split).transpose(d, d + 1).reshape(shape)
        return torch.cat((kept, grouped), dim=d)

    def in_bytes(self, ggml_type: int) -> TiledHeads | None:
        """The same order on the rows of a tensor's raw bytes [rows, row bytes]; None where a column run
        does not fall on whole blocks of `ggml_type`."""
        if self.dim == 0:
            return self
        block_size, block_bytes = GGML_BLOCKS[ggml_type]
        if self.head_size % block_size or self.start % block_size:
            return None
        return replace(self, start=self.start // block_size * block_bytes,
                       head_size=self.head_size // block_size * block_bytes)


def tiled_heads(module: str, shapes: LinearShapes) -> TiledHeads | None:
    """How a Gated DeltaNet tensor (its GGUF module: `attn_qkv`, `ssm_out`, ...) holds its value heads
    tiled; None where it has none, or where each key head serves one value head (nothing moved)."""
    if shapes.num_value_heads == shapes.num_key_heads or shapes.num_value_heads % shapes.num_key_heads:
        return None
    qk_width = 2 * shapes.num_key_heads * shapes.key_head_dim
    dim, start, head_size = {
        "attn_qkv": (0, qk_width, shapes.value_head_dim), "ssm_conv1d": (0, qk_width, shapes.value_head_dim),
        "attn_gate": (0, 0, shapes.value_head_dim), "ssm_out": (1, 0, shapes.value_head_dim),
        "ssm_beta": (0, 0, 1), "ssm_alpha": (0, 0, 1), "ssm_a": (0, 0, 1), "ssm_dt": (0, 0, 1),
    }.get(module, (None, 0, 0))
    if dim is None:
        return None
    return TiledHeads(dim, start, shapes.num_key_heads, shapes.num_value_heads // shapes.num_key_heads, head_size)


def a_log_from_ssm_a(ssm_a: torch.Tensor, name: str) -> torch.Tensor:
    """A_log = log(-ssm_a), in float64 and rounded once to float32 (ssm_a = -exp(A_log) is negative)."""
    if not bool((ssm_a < 0).all()):
        raise ValueError(f"{name}: llama.cpp's ssm_a is -exp(A_log), negative; this file's is not")
    return torch.log(-ssm_a.double()).float()


def attention_kv_heads(header: GGUFHeader, arch: str) -> int | None:
    """The attention layers' one KV head count, where `attention.head_count_kv` holds one a layer (0: a layer
    without attention); None where no layer has attention."""
    counts = set(_kv_head_counts(header, arch)) - {0}
    if len(counts) > 1:
        raise ValueError(f"{header.path}: GGUF key {arch}.attention.head_count_kv gives the attention layers "
                         f"different KV head counts {sorted(counts)}; one count for all of them is supported")
    return counts.pop() if counts else None


def short_conv_keys(header: GGUFHeader, arch: str, config: dict) -> dict:
    """LFM2's config.json keys beside the common ones (`config`: those read and checked so far): layer_types,
    conv_L_cache, conv_bias (from the tensors), norm_eps, and block_auto_adjust_ff_dim."""
    num_layers, counts = config["num_hidden_layers"], _kv_head_counts(header, arch)
    counts = counts * num_layers if len(counts) == 1 else counts  # one number: every layer's
    if len(counts) != num_layers:
        raise ValueError(f"{header.path}: GGUF key {arch}.attention.head_count_kv holds {len(counts)} counts for "
                         f"{num_layers} layers ({arch}.block_count)")
    key = f"{arch}.shortconv.l_cache"
    kernel = header.metadata.get(key)
    if isinstance(kernel, bool) or not isinstance(kernel, int) or not 2 <= kernel <= 64:
        raise ValueError(f"{header.path}: GGUF key {key}={kernel!r} must be an integer in 2..64 (the conv's kernel)")
    if config.get("rms_norm_eps") is None:  # llama.cpp requires it too: no default to fall back on
        raise ValueError(f"{header.path}: GGUF key {arch}.attention.layer_norm_rms_epsilon is missing")
    return dict(
        layer_types=[FULL if count else CONV for count in counts], conv_L_cache=kernel,
        conv_bias=any(t.name.endswith(".shortconv.in_proj.bias") for t in header.tensors),
        norm_eps=config["rms_norm_eps"],
        block_auto_adjust_ff_dim=False,  # feed_forward_length is the width the converter adjusted already
    )


def _kv_head_counts(header: GGUFHeader, arch: str) -> list[int]:
    """`attention.head_count_kv` as a list: one count a layer, or one for all (a list of one), each checked."""
    key = f"{arch}.attention.head_count_kv"
    value = header.metadata.get(key)
    values = list(value) if isinstance(value, np.ndarray | list) else [value]
    is_counts = all(isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in values)
    if not values or not is_counts or not all(0 <= v <= _MAX_KV_HEADS for v in values):
        raise ValueError(f"{header.path}: GGUF key {key}={value!r} must be a KV head count in 0..{_MAX_KV_HEADS}, "
                         "or one a layer")
    return [int(v) for v in values]


def mamba2_keys(header: GGUFHeader, arch: str, config: dict) -> dict:
    """Granite 4.0-H's config.json keys beside the common ones (`config`: those read and checked so far):
    layer_types, the mamba_* keys (their sizes checked again by the config's reader), the biases (from the
    tensors), shared_intermediate_size, num_local_experts, the multipliers and position_embedding_type."""
    meta, names, hidden = header.metadata, {t.name for t in header.tensors}, config["hidden_size"]
    counts, head_dim = _kv_head_counts(header, arch), _head_dim(config)
    if len(counts) != config["num_hidden_layers"]:
        raise ValueError(f"{header.path}: GGUF key {arch}.attention.head_count_kv holds {len(counts)} counts for "
                         f"{config['num_hidden_layers']} layers ({arch}.block_count)")

    def number(key: str) -> int:
        return _positive_int(header, f"{arch}.ssm.{key}")

    heads, inner = number("time_step_rank"), number("inner_size")
    if inner % heads or inner % hidden:
        raise ValueError(f"{header.path}: GGUF key {arch}.ssm.inner_size={inner} must be a multiple of "
                         f"{arch}.ssm.time_step_rank={heads} and of the hidden size {hidden}")
    keys = dict(
        layer_types=[FULL if count else LINEAR for count in counts], mamba_n_heads=heads,
        mamba_d_head=inner // heads, mamba_expand=inner // hidden, mamba_n_groups=number("group_count"),
        mamba_d_state=number("state_size"), mamba_d_conv=number("conv_kernel"),
        mamba_conv_bias=any(name.endswith(".ssm_conv1d.bias") for name in names),
        mamba_proj_bias=any(name.endswith(".ssm_in.bias") for name in names),
        shared_intermediate_size=meta.get(f"{arch}.expert_shared_feed_forward_length", config["intermediate_size"]),
        num_local_experts=config.get("num_experts") or 0,
        position_embedding_type=_mamba2_position(header, arch, head_dim),
    )
    keys.update({key: meta[f"{arch}.{name}"] for name, key in _MULTIPLIERS.items() if f"{arch}.{name}" in meta})
    scale = keys.get("attention_multiplier")  # llama.cpp: 1 / sqrt(head size) where it is absent or 0 (not false)
    if scale is None or (isinstance(scale, int | float) and not isinstance(scale, bool) and scale == 0):
        keys["attention_multiplier"] = head_dim**-0.5
    return keys


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _mamba2_position(header: GGUFHeader, arch: str, head_dim: int) -> str:
    """"rope" or "nope" as llama.cpp reads them: RoPE unless `rope.scaling.finetuned` is false (its converter
    writes false for every Granite 4.0-H), on every feature of a head (`rope.dimension_count`, its rotary
    width, is then the head size: HF's Granite has no partial RoPE)."""
    meta, key = header.metadata, f"{arch}.rope.scaling.finetuned"
    finetuned = meta.get(key, True)
    if not isinstance(finetuned, bool | np.bool_):  # llama.cpp refuses another type; "false" would read as true
        raise ValueError(f"{header.path}: GGUF key {key}={finetuned!r} must be true or false")
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    is_int = isinstance(rotary, int | np.integer) and not isinstance(rotary, bool | np.bool_)
    if finetuned and not (is_int and rotary == head_dim):
        raise ValueError(f"{header.path}: GGUF key {arch}.rope.dimension_count={rotary!r} must be the head size "
                         f"{head_dim}: RoPE on part of each head is not supported for {arch}")
    return "rope" if finetuned else "nope"
