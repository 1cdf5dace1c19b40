"""The Python/C seam of the CPU kernels (engine-core process): each exported function's signature
with its arguments named, the structs the fused decode forward reads (mirrors of
csrc/decode_forward.h), and `CpuKernels`, the loaded functions with what the CPU can do.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

_P, _I32, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class LayerDesc(ctypes.Structure):
    """struct layer_desc: one decoder layer's weights (fp32, bf16 bits or GGUF blocks), KV cache and shapes."""

    _fields_ = [
        *((name, _P) for name in ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias",
                                  "post_norm", "gate_up", "down", "key_cache", "value_cache")),
        *((name, _I64) for name in ("hidden", "num_q_heads", "num_kv_heads", "head_dim", "intermediate",
                                    "num_slots", "is_bf16", "window", "qkv_type", "o_type", "gate_up_type",
                                    "down_type", "is_nope")),
    ]


class QuantPart(ctypes.Structure):
    """struct quant_part (csrc/kernel_parts.h): a run of a product's rows in GGUF blocks of one type; an
    array of them, ended by one of 0 rows, is a product of type QUANT_PARTS."""

    _fields_ = [("w", _P), ("type", _I64), ("rows", _I64)]


class LoraPart(ctypes.Structure):
    """struct lora_part (csrc/lora_rows.c): one target's B (transposed), where its columns start and its
    entries of h."""

    _fields_ = [("start", _I64), ("width", _I64), ("offset", _I64), ("rank", _I64), ("bt", _P), ("scale", _F32)]


class LoraGroup(ctypes.Structure):
    """struct lora_group: one adapter's A rows for one product (its parts' together) and its parts."""

    _fields_ = [("a", _P), ("rank", _I64), ("num_parts", _I64), ("parts", ctypes.POINTER(LoraPart))]


class ModelDesc(ctypes.Structure):
    """struct model_desc: what every step of one model shares; `layers` points at a LayerDesc array."""

    _fields_ = [
        ("embed", _P),
        ("embed_is_bf16", _I64),
        ("final_norm", _P),
        ("cos", _P),
        ("sin", _P),
        ("num_layers", _I64),
        ("layers", ctypes.POINTER(LayerDesc)),
        ("embed_quant_type", _I64),
        ("lm_head", _P),
        ("lm_head_bias", _P),
        ("lm_head_is_bf16", _I64),
        ("lm_head_quant_type", _I64),
        ("vocab", _I64),
        ("int8_activations", _I64),
    ]


class StepDesc(ctypes.Structure):
    """struct step_desc: one decode step's rows."""

    _fields_ = [
        *((name, _P) for name in ("input_ids", "positions", "slots", "rows", "block_tables")),
        ("max_blocks", _I64),
        ("context_lens", _P),
        *((name, _I64) for name in ("num_tokens", "block_size", "use_dot", "num_threads")),
        ("logits", _P),
        ("lora_groups", _P),
        ("lora_products", _P),
        ("num_lora_groups", _I64),
    ]


@dataclass(frozen=True)
class Signature:
    restype: type | None
    args: tuple[tuple[str, type], ...]  # (name, ctypes type), in the C order


def _sig(restype: type | None, *args: tuple[str, type]) -> Signature:
    return Signature(restype, args)


_PRODUCT = (("x", _P), ("num_rows", _I64), ("num_in", _I64), ("weight", _P), ("num_out", _I64),
            ("bias", _P), ("out", _P))
SIGNATURES: dict[str, Signature] = {
    "decode_attention": _sig(
        _INT, ("q", _P), ("out", _P), ("key_cache", _P), ("value_cache", _P), ("num_slots", _I64),
        ("rows", _P), ("block_tables", _P), ("max_blocks", _I32), ("context_lens", _P),
        ("num_rows", _I32), ("num_q_heads", _I32), ("num_kv_heads", _I32), ("head_dim", _I32),
        ("block_size", _I32), ("scale", _F32), ("window", _I32), ("softcap", _F32), ("sinks", _P),
        ("num_threads", _I32),
    ),
    "logprob_rows": _sig(
        None, ("scores", _P), ("num_rows", _I64), ("vocab", _I64), ("row_stride", _I64), ("k", _I32),
        ("values", _P), ("ids", _P), ("lse", _P), ("num_threads", _I32),
    ),
    "argmax_rows": _sig(
        None, ("scores", _P), ("num_rows", _I64), ("vocab", _I64), ("row_stride", _I64), ("ids", _P),
        ("num_threads", _I32),
    ),
    "rope_write_kv": _sig(
        None, ("qkv", _P), ("cos", _P), ("signed_sin", _P), ("slots", _P), ("num_tokens", _I64),
        ("num_q_heads", _I32), ("num_kv_heads", _I32), ("head_dim", _I32), ("q_out", _P), ("k_out", _P),
        ("key_cache", _P), ("value_cache", _P), ("num_slots", _I64), ("num_threads", _I32),
    ),
    "silu_mul": _sig(
        None, ("gate_up", _P), ("num_tokens", _I64), ("intermediate", _I64), ("out", _P), ("num_threads", _I32)
    ),
    "rms_norm": _sig(
        None, ("x", _P), ("delta", _P), ("num_tokens", _I64), ("hidden", _I64), ("weight", _P), ("eps", _F32),
        ("sum_out", _P), ("out", _P), ("num_threads", _I32),
    ),
    "sigmoid": _sig(None, ("x", _P), ("n", _I64), ("out", _P)),
    "gemv_f32": _sig(None, *_PRODUCT, ("num_threads", _I32)),
    "gemv_bf16": _sig(_INT, *_PRODUCT, ("use_dot", _I32), ("num_threads", _I32)),
    "cpu_has_bf16_dot": _sig(_INT),
    "gemm_bf16_amx": _sig(_INT, *_PRODUCT, ("num_threads", _I32)),
    "cpu_has_amx": _sig(_INT),
    "gemv_quant": _sig(
        _I32, ("x", _P), ("num_rows", _I64), ("num_in", _I64), ("weight", _P), ("ggml_type", _I32),
        ("num_out", _I64), ("bias", _P), ("out", _P), ("num_threads", _I32),
    ),
    "gemv_int8": _sig(
        _I32, ("x", _P), ("num_rows", _I64), ("num_in", _I64), ("weight", _P), ("ggml_type", _I32),
        ("num_out", _I64), ("bias", _P), ("out", _P), ("num_threads", _I32),
    ),
    "int8_kernel_kind": _sig(_I32),
    "lora_rows": _sig(
        _I32, ("x", _P), ("rows", _I64), ("num_in", _I64), ("out", _P), ("out_width", _I64),
        ("group_of_row", _P), ("groups", _P), ("num_groups", _I32), ("num_threads", _I32),
    ),
    "dequantize_rows": _sig(
        _I32, ("weight", _P), ("ggml_type", _I32), ("num_rows", _I64), ("num_in", _I64), ("out", _P)
    ),
    "quant_type_supported": _sig(_I32, ("ggml_type", _I32), ("num_in", _I64)),
    "decode_forward": _sig(
        _INT, ("model", ctypes.POINTER(ModelDesc)), ("step", ctypes.POINTER(StepDesc)), ("out", _P),
        ("eps", _F32), ("scale", _F32),
    ),
    "decode_forward_layout": _sig(_I64, ("type", ctypes.c_char_p), ("field", ctypes.c_char_p)),
    "gated_deltanet_span": _sig(
        _INT, ("proj", _P), ("stride", _I64), ("num_tokens", _I64), ("conv_state", _P), ("ssm_state", _P),
        ("taps", _P), ("a_log", _P), ("dt_bias", _P), ("norm_weight", _P), ("eps", _F32),
        ("num_key_heads", _I64), ("num_value_heads", _I64), ("key_head_dim", _I64), ("value_head_dim", _I64),
        ("kernel", _I64), ("scratch", _P), ("out", _P), ("num_threads", _I32),
    ),
    "mamba2_span": _sig(
        _INT, ("proj", _P), ("stride", _I64), ("num_tokens", _I64), ("conv_state", _P), ("ssm_state", _P),
        ("taps", _P), ("conv_bias", _P), ("a_log", _P), ("dt_bias", _P), ("d", _P), ("norm_weight", _P),
        ("eps", _F32), ("num_heads", _I64), ("head_dim", _I64), ("num_groups", _I64), ("state_size", _I64),
        ("kernel", _I64), ("scratch", _P), ("out", _P), ("num_threads", _I32),
    ),
}


@dataclass(frozen=True)
class CpuKernels:
    decode_attention: ctypes._CFuncPtr
    logprob_rows: ctypes._CFuncPtr
    argmax_rows: ctypes._CFuncPtr
    rope_write_kv: ctypes._CFuncPtr
    silu_mul: ctypes._CFuncPtr
    rms_norm: ctypes._CFuncPtr
    sigmoid: ctypes._CFuncPtr
    gemv_f32: ctypes._CFuncPtr
    gemv_bf16: ctypes._CFuncPtr
    cpu_has_bf16_dot: ctypes._CFuncPtr
    gemm_bf16_amx: ctypes._CFuncPtr
    cpu_has_amx: ctypes._CFuncPtr
    gemv_quant: ctypes._CFuncPtr
    gemv_int8: ctypes._CFuncPtr
    int8_kernel_kind: ctypes._CFuncPtr
    lora_rows: ctypes._CFuncPtr
    dequantize_rows: ctypes._CFuncPtr
    quant_type_supported: ctypes._CFuncPtr
    decode_forward: ctypes._CFuncPtr
    decode_forward_layout: ctypes._CFuncPtr
    gated_deltanet_span: ctypes._CFuncPtr
    mamba2_span: ctypes._CFuncPtr
    has_bf16_dot: bool = False  # this CPU runs AVX512-BF16's dot instruction (asked at load)
    has_amx: bool = False  # this CPU runs AMX-BF16 and the kernel grants the tiles (asked at load)


def bind(library: ctypes.CDLL) -> CpuKernels:
    """The library's functions with their signatures set. AttributeError: a function is missing."""
    functions = {name: getattr(library, name) for name in SIGNATURES}
    for name, function in functions.items():
        signature = SIGNATURES[name]
        function.argtypes = [kind for _, kind in signature.args]
        function.restype = signature.restype
    return CpuKernels(
        **functions,
        has_bf16_dot=bool(functions["cpu_has_bf16_dot"]()),
        has_amx=bool(functions["cpu_has_amx"]()),
    )
