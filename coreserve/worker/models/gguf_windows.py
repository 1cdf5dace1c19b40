"""A GGUF file's sliding-window layers read back into config.json's keys (engine-core process): for `olmo2`
(OLMo 3 is written so, with its windows), `exaone4` and `gpt-oss`, `attention.sliding_window` and the layers it
applies to, `attention.sliding_window_pattern`: a bool a layer (true: sliding), or every n-th layer global; absent,
every fourth (`gpt-oss`: every second), as llama.cpp's load_swa_pattern reads these architectures. OLMo 3's sliding
layers rotate with the default RoPE at `rope.freq_base_swa` (the global base where absent), unscaled, as llama.cpp
rotates them. A file without a window has none: `sliding_window` null, not the HF configs' default of 4096, and
every layer global (not the pattern Exaone 4's HF config would derive, whose sliding layers would want a window).
Where the architecture's sliding layers have no RoPE of their own (exaone4, gpt-oss), a `rope.freq_base_swa`
other than the global base is refused by name.
"""

from __future__ import annotations

import numpy as np

from coreserve.protocol.gguf_header import GGUFHeader

_FULL, _SLIDING = "full_attention", "sliding_attention"
_LLAMA_CPP_PATTERN = 4  # load_swa_pattern's default for olmo2 and exaone4: every fourth layer global


def window_keys(
    header: GGUFHeader, arch: str, config: dict, has_local_rope: bool, pattern: int = _LLAMA_CPP_PATTERN
) -> dict:
    """Without a window: {"sliding_window": None} and every layer global; else the window, layer_types, and where
    `has_local_rope` the RoPE of each kind of layer (rope_parameters by layer kind, as transformers 5 writes
    OLMo 3's)."""
    if not has_local_rope:  # llama.cpp would rotate the sliding layers at their own base; HF's model has one RoPE
        base = header.metadata.get(f"{arch}.rope.freq_base_swa")
        if base is not None and base != config["rope_parameters"]["rope_theta"]:
            raise ValueError(f"{header.path}: GGUF key {arch}.rope.freq_base_swa={str(base)[:60]} (the sliding "
                             f"layers' own RoPE base) is not supported: {arch} rotates every layer alike")
    window = config.get("sliding_window")  # checked as config.json's (config_checks.py)
    if not window:
        return {"sliding_window": None, "layer_types": [_FULL] * config["num_hidden_layers"]}
    kinds = layer_kinds(header, arch, config["num_hidden_layers"], pattern)
    keys: dict = {"sliding_window": window, "layer_types": kinds}
    if has_local_rope:
        base = header.metadata.get(f"{arch}.rope.freq_base_swa", config["rope_parameters"]["rope_theta"])
        if isinstance(base, bool) or not isinstance(base, int | float) or not 0 < base < float("inf"):
            raise ValueError(f"{header.path}: GGUF key {arch}.rope.freq_base_swa={base!r} must be a positive number")
        local = {"rope_type": "default", "rope_theta": float(base)}
        keys["rope_parameters"] = {_FULL: config["rope_parameters"], _SLIDING: local}
    return keys


def layer_kinds(header: GGUFHeader, arch: str, num_layers: int, default: int) -> list[str]:
    """Each layer's kind from the pattern: a bool a layer, or an integer n (every n-th layer global; `default`
    where the key is absent). Gemma 3's files are read by it too."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = header.metadata.get(key, default)
    if isinstance(pattern, bool) or isinstance(pattern, int):
        if isinstance(pattern, bool) or pattern < 1:
            raise ValueError(f"{header.path}: GGUF key {key}={pattern!r} must be a positive integer or a bool a layer")
        return [_FULL if (i + 1) % pattern == 0 else _SLIDING for i in range(num_layers)]
    values = list(pattern) if hasattr(pattern, "__len__") and not isinstance(pattern, str) else None
    if values is None or len(values) != num_layers or not all(_is_flag(v) for v in values):
        raise ValueError(f"{header.path}: GGUF key {key} must hold a bool for each of the {num_layers} layers")
    return [_SLIDING if v else _FULL for v in values]


def _is_flag(value: object) -> bool:
    """A bool, or an integer 0 or 1 (not a float: llama.cpp reads the pattern as an array of flags)."""
    return isinstance(value, bool | np.bool_) or (isinstance(value, int | np.integer) and value in (0, 1))
