"""A GGUF file's RoPE keys read back into HF's `rope_parameters` (engine-core process): the scaling type and
its factor, Phi-3's LongRoPE (factors kept as two F32 tensors, the original context, the attention factor) and
partial rotary; every numeric key checked to be a finite number (`meta_number`) before float() or int() meets
it. coreserve/worker/models/gguf_config.py calls these.
"""

from __future__ import annotations

import math

from coreserve.protocol.gguf_header import GGUFHeader

_ROPE_SCALINGS = ("none", "linear", "yarn")


def longrope_keys(header: GGUFHeader, arch: str, config: dict) -> dict:
    """Phi-3's partial rotary and LongRoPE keys: the factors kept as two F32 tensors, the original context and
    the attention factor (where it is not HF's default) from the metadata."""
    meta, keys = header.metadata, {}
    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads
    rotary = int(meta_number(header, f"{arch}.rope.dimension_count", head_dim))
    keys["partial_rotary_factor"] = rotary / head_dim
    long, short = _rope_factors(header)
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if long is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise ValueError(f"{header.path}: LongRoPE factors need {arch}.rope.scaling.original_context_length, "
                         f"a positive integer (got {original!r})")
    if long is not None:
        keys["rope_parameters"] = {
            "rope_type": "longrope", "rope_theta": float(config.get("rope_theta", 10000.0)),
            "long_factor": long, "short_factor": short, "partial_rotary_factor": rotary / head_dim,
            "original_max_position_embeddings": original,
        }
        attention = meta_number(header, f"{arch}.rope.scaling.attn_factor", None, optional=True)
        if attention is not None and not _is_default_attention(float(attention), config, keys["rope_parameters"]):
            keys["rope_parameters"]["attention_factor"] = float(attention)
    return keys


def _is_default_attention(attention: float, config: dict, rope: dict) -> bool:
    """Whether the file's LongRoPE attention factor is HF's own default (written as a float32), which
    is then computed as HF computes it."""
    original = rope["original_max_position_embeddings"]
    factor = config["max_position_embeddings"] / original
    default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return abs(attention - default) <= 1e-6 * default


def meta_number(header: GGUFHeader, key: str, default: object, optional: bool = False) -> int | float | None:
    """A numeric GGUF key (`default` where absent); an array, a string, a bool or a non-finite value is refused
    by name before any float() or int() meets it. None where absent and `optional`."""
    value = header.metadata.get(key, default)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{header.path}: GGUF key {key}={str(value)[:60]} must be a finite number")
    return value


def _rope_factors(header: GGUFHeader) -> tuple[list[float] | None, list[float] | None]:
    """Phi-3's LongRoPE factors: llama.cpp keeps them as two F32 tensors."""
    import numpy as np

    found = {}
    for info in header.tensors:
        if info.name in ("rope_factors_long.weight", "rope_factors_short.weight") and info.ggml_type == 0:
            values = np.memmap(header.path, dtype="<f4", mode="r", offset=info.offset, shape=(info.dims[0],))
            found[info.name] = [float(v) for v in values]
    return found.get("rope_factors_long.weight"), found.get("rope_factors_short.weight")


def rope_parameters(header: GGUFHeader, arch: str, theta: object) -> dict:
    """rope_parameters from the file's scaling keys: default, linear or YaRN (linear where a factor has no type)."""
    meta = header.metadata
    # llama.cpp's type where the key is absent is linear, which a factor then scales by (found by the
    # untrusted-input fuzzer: a factor without a type was ignored here)
    has_factor = meta.get(f"{arch}.rope.scaling.factor") is not None
    scaling = str(meta.get(f"{arch}.rope.scaling.type", "linear" if has_factor else "none"))
    if scaling not in _ROPE_SCALINGS:
        raise ValueError(f"{header.path}: GGUF RoPE scaling {scaling!r} is not supported; supported: "
                         f"{list(_ROPE_SCALINGS)}")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    params = {"rope_type": scaling, "rope_theta": theta,
              "factor": float(meta_number(header, f"{arch}.rope.scaling.factor", None))}
    original = meta_number(header, f"{arch}.rope.scaling.original_context_length", None, optional=True)
    if original:
        params["original_max_position_embeddings"] = int(original)
    return params
