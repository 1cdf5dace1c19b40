"""The numbers of a model's config checked before anything is built or allocated from them
(engine-core process): config.json and a GGUF file's metadata are untrusted input, like a request body.

Three steps, each a ValueError naming the key: `check_config_numbers` (types, ranges and the relations
between heads, KV heads and token ids, before any shape is computed); `check_layer_indices` (the layer
count against the layers whose tensors the file holds, before a layer is built); `check_model_fits_file`
(the elements the built model would allocate, on the meta device, against those the file's tensors hold).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

# key -> largest value accepted: beyond every released model, small enough that nothing sized from it
# before the tensors are compared (the RoPE tables, a layer's spec) is large
_INT_BOUNDS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "intermediate_size": 1 << 20,  # a GGUF mixture of experts may give only the experts' width
}
_REQUIRED = tuple(_INT_BOUNDS)
_OPTIONAL_INT_BOUNDS = {
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 21,
    "sliding_window": 1 << 24,  # some configs write a window past their context
    "num_experts": 1 << 12,
    "num_local_experts": 1 << 12,
    "num_experts_per_tok": 1 << 12,
    "moe_intermediate_size": 1 << 20,
    "decoder_sparse_step": 1 << 10,
}
# 0: no experts (Granite 4.0-H's dense variant writes 0 for all three); a top-k of 0 with experts is refused below
_ZERO_MEANS_NONE = ("num_experts", "num_local_experts", "num_experts_per_tok")
_MAX_ROPE_ELEMENTS = 1 << 27  # max_position_embeddings x head_dim: each RoPE table's fp32 elements
_POSITIVE_FLOATS = ("rope_theta", "attn_logit_softcapping", "final_logit_softcapping", "clip_qkv",
                    "query_pre_attn_scalar", "rope_local_base_freq", "embedding_multiplier", "residual_multiplier",
                    "attention_multiplier", "logits_scaling", "swiglu_alpha", "swiglu_limit")
FLOAT32_MAX = 3.4028234663852886e38  # past it a positive float is infinite where the model applies it in float32
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id")  # what the engine reads (a pad id of -1 is common and unread)
# a layer's tensors: under model. (a vision-language folder's model.language_model.), a bare *Model's without
# a prefix, a GGUF file's blk.N.
_LAYER_PATTERNS = (re.compile(r"^(?:model\.(?:language_model\.)?)?layers\.(\d+)\."), re.compile(r"^blk\.(\d+)\."))
_SLACK_ELEMENTS = 1 << 20  # buffers a model holds beyond its checkpoint's tensors


def check_config_numbers(
    config: dict, names: dict[str, str] | None = None, required: tuple[str, ...] = _REQUIRED
) -> None:
    """`names`: how the message calls a key (a GGUF file's own key names); config.json's by default."""
    if not isinstance(config, dict):
        raise ValueError(f"config.json must be a JSON object, not {type(config).__name__}")
    def name(key: str) -> str:
        return (names or {}).get(key, key)

    for key in required:
        if config.get(key) is None:
            raise ValueError(f"the model's config has no {name(key)}")
    for key, bound in {**_INT_BOUNDS, **_OPTIONAL_INT_BOUNDS}.items():
        is_none = key in _ZERO_MEANS_NONE and type(config.get(key)) is int and config[key] == 0
        if config.get(key) is not None and not is_none:
            _check_int(config[key], name(key), bound)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"{name('num_attention_heads')}={heads} is not a multiple of "
                         f"{name('num_key_value_heads')}={kv_heads}: each KV head must serve whole query heads")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if config["hidden_size"] < heads:
        raise ValueError(f"{name('hidden_size')}={config['hidden_size']} has fewer features than "
                         f"{name('num_attention_heads')}={heads} heads")
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts and config.get("num_experts_per_tok") == 0:
        raise ValueError(f"{name('num_experts_per_tok')}=0: each token must take at least one of the {experts} experts")
    if experts and (config.get("num_experts_per_tok") or 0) > experts:
        raise ValueError(f"{name('num_experts_per_tok')}={config['num_experts_per_tok']} is more than the {experts} "
                         f"experts ({name('num_experts')})")
    positions = config.get("max_position_embeddings") or 2048
    if positions * head_dim > _MAX_ROPE_ELEMENTS:
        raise ValueError(f"{name('max_position_embeddings')}={positions} x a head of {head_dim} is over "
                         f"{_MAX_ROPE_ELEMENTS} RoPE table entries")
    _check_floats(config, name)
    _check_token_ids(config, name)


def check_layer_indices(num_layers: int, tensor_names: Iterable[str], where: str) -> None:
    """Every layer 0..num_layers-1 has tensors in the file, and no tensor is of a layer past them."""
    found = {int(m.group(1)) for n in tensor_names for p in _LAYER_PATTERNS if (m := p.match(n))}
    if found != set(range(num_layers)):
        missing = sorted(set(range(num_layers)) - found)[:3]
        extra = sorted(found - set(range(num_layers)))[:3]
        detail = f"no tensors of layers {missing}" if missing else f"tensors of layers {extra} past them"
        raise ValueError(f"{where}: the config says {num_layers} layers, but the file has {detail}")


def check_model_fits_file(model_elements: int, file_elements: int, where: str) -> None:
    """The model the config describes holds no more elements than the file's tensors (a config that
    claims wider or more layers than its tensors is refused before its memory is allocated)."""
    if model_elements > file_elements + file_elements // 100 + _SLACK_ELEMENTS:
        raise ValueError(f"{where}: the config describes a model of {model_elements} weights, but the "
                         f"file's tensors hold {file_elements}: its sizes do not match its tensors")


def _check_int(value: object, name: str, bound: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not 1 <= value <= bound:
        raise ValueError(f"{name}={value} is out of range (1..{bound})")


def _check_floats(config: dict, name) -> None:
    for key in ("rms_norm_eps", "norm_eps"):  # LFM2 reads norm_eps
        eps = config.get(key, 1e-6)
        if not _is_real(eps) or not 0 < eps < 1:
            raise ValueError(f"{name(key)}={eps!r} must be a finite number in (0, 1)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling must be an object, got {rope!r}")
    values = {**{k: config.get(k) for k in _POSITIVE_FLOATS}, "rope_theta": rope.get("rope_theta", config.get("rope_theta"))}
    values.update({f"rope_scaling.{k}": rope.get(k) for k in ("factor", "attention_factor")})
    for key, value in values.items():
        if value is not None and (not _is_real(value) or not 0 < value <= FLOAT32_MAX):
            raise ValueError(f"{name(key)}={value!r} must be a positive number, finite in float32")


def _check_token_ids(config: dict, name) -> None:
    vocab = config["vocab_size"]
    for key in _TOKEN_ID_KEYS:
        value = config.get(key)
        for token_id in value if isinstance(value, list) else [] if value is None else [value]:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
                raise ValueError(f"{name(key)}={value!r}: token ids are integers in 0..{vocab - 1}")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
