"""What each decoder layer computes, read once from config.json under its family's rules
(coreserve/worker/models/family.py) into a frozen `LayerSpec`: its norms, attention (window, scale, soft-cap),
RoPE (or NoPE: SmolLM3's listed layers, Exaone 4's global ones), q/k norms and MLP (engine-core process). The
one layer body (coreserve/worker/models/decoder.py) and the fused decode forward's descriptors
(coreserve/worker/cpu/fused_decode.py) read these specs, never a family.
"""

from __future__ import annotations

from dataclasses import dataclass

from coreserve.worker.models.config_checks import FLOAT32_MAX
from coreserve.worker.models.family import FULL, LINEAR, SHORT_CONV, SILU, SLIDING, Family
from coreserve.worker.models.rope import NO_ROPE, SUPPORTED_ROPE_TYPES, RopeSpec
from coreserve.worker.step.attention import AttentionSpec


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    rope: RopeSpec  # this layer's RoPE (Gemma 3's sliding layers have their own; NO_ROPE: none)
    norm_offset: float  # every RMSNorm of the layer scales by offset + weight (0, or Gemma's 1)
    has_sandwich_norms: bool  # norms on attention's and the MLP's outputs before the residual adds them
    qk_norm: str | None  # "head": each head of q and k, before RoPE; "whole": all of q, all of k; None
    clip_qkv: float | None  # q, k and v clamped to [-clip, clip] after the norms; None: not clamped
    activation: str  # the gated MLP's: SILU (SwiGLU) or GELU_TANH (GeGLU)
    is_moe: bool  # the MLP is a mixture of experts (DecoderArgs.moe), else dense
    mixer: str = "attention"  # or GATED_DELTANET, SHORT_CONV, MAMBA2: a recurrent mixer, no KV cache
    has_output_gate: bool = False  # attention's output times sigmoid(gate) before o_proj (Qwen3.5)
    residual_multiplier: float | None = None  # Granite: residual + out * multiplier, the mixer's and the MLP's
    has_pre_norms: bool = True  # norms on attention's and the MLP's inputs (OLMo 2/3, Exaone 4: the outputs' only)
    has_v_norm: bool = False  # RMSNorm without a weight over each head of v (Gemma 4; with qk_norm "head")
    has_layer_scalar: bool = False  # the layer's output times its layer_scalar tensor [1] (Gemma 4)
    has_sinks: bool = False  # a learned logit a head joins the attention's softmax (gpt-oss)

    @property
    def is_llama_shaped(self) -> bool:
        """Whether decode_forward.c computes this layer: a window, per-head q/k norms, biases at most."""
        return (
            self.attention.scale is None and self.attention.softcap is None and not self.norm_offset
            and not self.has_sandwich_norms and self.qk_norm in (None, "head") and self.clip_qkv is None
            and self.activation == SILU and not self.is_moe and self.mixer == "attention"
            and not self.has_output_gate and self.residual_multiplier is None and self.has_pre_norms
            and not self.has_v_norm and not self.has_layer_scalar and not self.has_sinks
        )


def layer_specs(
    config: dict, family: Family, rope: RopeSpec, dense_layers: tuple[int, ...], head_dim: int, max_positions: int
) -> tuple[LayerSpec, ...]:
    """Each layer's spec; `rope` is the model's (the global layers'), `dense_layers` a mixture's layers
    with a dense MLP."""
    windows = _windows(config, family)
    local_rope = _local_rope(config, family, head_dim, max_positions)
    nope = nope_layers(config, family, windows)
    assert not (nope and local_rope is not None), "DecoderModel holds two RoPE tables: the model's and one other"
    scale, softcap = None, None
    if family.has_softcaps:
        scale = float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5
        softcap = config.get("attn_logit_softcapping")
    if family.attention_scale is not None:
        scale = family.attention_scale
    residual = None
    if family.has_multipliers:  # HF's default 1: a scale of 1, not head_dim ** -0.5
        scale, residual = multiplier(config, "attention_multiplier"), multiplier(config, "residual_multiplier")
    clip = (config.get("clip_qkv") or None) if family.has_clip_qkv else None
    kinds = layer_kinds(config, family)
    is_causal = not (family.can_be_bidirectional and config.get("use_bidirectional_attention"))
    return tuple(
        LayerSpec(
            attention=_attention_spec(window, scale, softcap, is_causal),
            rope=_layer_rope(rope, local_rope if window is not None else None, i in nope),
            norm_offset=family.norm_offset,
            has_sandwich_norms=family.has_sandwich_norms,
            qk_norm=family.qk_norm,
            clip_qkv=clip,
            activation=family.activation,
            is_moe=family.moe is not None and i not in dense_layers,
            mixer=family.recurrent if family.recurrent and kinds[i] == family.recurrent_layer else "attention",
            has_output_gate=family.has_output_gate,
            residual_multiplier=None if residual == 1 else residual,
            has_pre_norms=family.has_pre_norms,
            has_v_norm=family.has_v_norm,
            has_layer_scalar=family.has_layer_scalar,
            has_sinks=family.has_sinks,
        )
        for i, window in enumerate(windows)
    )


def _attention_spec(window: int | None, scale: float | None, softcap: float | None, is_causal: bool) -> AttentionSpec:
    """A bidirectional layer's window is HF's: config.json's sliding_window // 2 + 1, keys nearer than it
    on either side (Gemma3TextConfig halves it so for use_bidirectional_attention)."""
    if not is_causal and window is not None:
        window = window // 2 + 1
    return AttentionSpec(window, scale, softcap, is_causal)


def _layer_rope(rope: RopeSpec, local: RopeSpec | None, is_nope: bool) -> RopeSpec:
    """A layer's RoPE: none (NoPE), the sliding layers' own, or the model's."""
    if is_nope:
        return RopeSpec(NO_ROPE, rope.theta, rope.head_dim, rope.max_position_embeddings)
    return local if local is not None else rope


def nope_layers(config: dict, family: Family, windows: list[int | None]) -> set[int]:
    """The layers without RoPE. SmolLM3: no_rope_layers[i] 0 (HF's use_rope = no_rope_layers[i]), by default
    every no_rope_layer_interval-th layer; Exaone 4: its global layers, where the model has windows (HF
    rotates every layer where sliding_window is null)."""
    num_layers = config["num_hidden_layers"]
    if family.nope == "global":
        return {i for i, window in enumerate(windows) if window is None} if config.get("sliding_window") else set()
    if family.nope != "listed":
        return set()
    listed = config.get("no_rope_layers")
    if listed is None:
        interval = config.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"no_rope_layer_interval={interval!r} must be a positive integer")
        return {i for i in range(num_layers) if (i + 1) % interval == 0}
    if not isinstance(listed, list) or len(listed) != num_layers or any(v not in (0, 1) for v in listed):
        raise ValueError(f"no_rope_layers must list 1 (RoPE) or 0 (none) for each of the {num_layers} layers")
    return {i for i, uses_rope in enumerate(listed) if not uses_rope}


def multiplier(config: dict, key: str) -> float:
    """Granite's multiplier `key`, HF's default 1 where absent or null (checked positive: config_checks.py)."""
    value = config.get(key)
    return 1.0 if value is None else float(value)


def layer_kinds(config: dict, family: Family) -> list[str]:
    """Each layer's kind as config.json's layer_types names it (older names as HF's: Granite's mamba); a hybrid
    config without the list: a full-attention layer every full_attention_interval (HF's default 4), the rest
    LINEAR, or every layer recurrent where that is the family's default."""
    num_layers = config["num_hidden_layers"]
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and family.kind_aliases:
        kinds = [dict(family.kind_aliases).get(kind, kind) if isinstance(kind, str) else kind for kind in kinds]
    if kinds is None and family.is_recurrent_by_default:
        return [family.recurrent_layer] * num_layers
    attention_layers = config.get("full_attn_idxs")  # LFM2's older configs: its attention layers' indices
    if kinds is None and family.recurrent == SHORT_CONV and attention_layers is None:
        attention_layers = list(range(num_layers))  # HF's LFM2 without either list: every layer attention
    if kinds is None and family.recurrent and isinstance(attention_layers, list):
        return [FULL if i in attention_layers else family.recurrent_layer for i in range(num_layers)]
    if kinds is None and family.recurrent:
        interval = config.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"full_attention_interval={interval!r} must be a positive integer")
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    kinds = kinds or [FULL] * num_layers
    if not isinstance(kinds, list) or len(kinds) != num_layers or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"layer_types must list a kind for each of the {num_layers} layers")
    return kinds


def _windows(config: dict, family: Family) -> list[int | None]:
    """Each layer's sliding window (None: a global layer)."""
    num_layers = config["num_hidden_layers"]
    if family.window == "model":
        return [config.get("sliding_window", family.default_window)] * num_layers
    if family.window != "layers":
        return [None] * num_layers
    kinds = config.get("layer_types")
    if not kinds:  # older configs: every pattern-th layer global, from a local one
        key = family.layer_pattern_key
        pattern = config.get(key, family.layer_pattern) if key else family.layer_pattern
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"{key}={pattern!r} must be a positive integer where layer_types is not given")
        kinds = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if family.forces_last_global:  # HF's Gemma 4 makes the last layer global whatever layer_types says
        kinds = [*kinds[:-1], FULL]
    window = config.get("sliding_window")
    if window is None and SLIDING in kinds:
        raise ValueError("sliding_attention layers need a sliding_window (config.json's is null)")
    return [window if kind == SLIDING else None for kind in kinds]


def global_rope_config(config: dict, family: Family) -> dict:
    """A RoPE per kind of layer (transformers 5's Gemma 3): the global layers' is the model's."""
    params = config.get("rope_parameters") or {}
    if family.rope_per_kind and FULL in params:
        return {**config, "rope_parameters": params[FULL]}
    return config


def _local_rope(config: dict, family: Family, head_dim: int, max_positions: int) -> RopeSpec | None:
    """The sliding layers' own RoPE; None: the model's."""
    params = config.get("rope_parameters") or {}
    if family.rope_per_kind and SLIDING in params:
        return rope_spec({**config, "rope_parameters": params[SLIDING]}, head_dim, max_positions)
    if family.local_rope_base is not None:
        key, default = family.local_rope_base
        base = config.get(key, default) if key is not None else default
        return RopeSpec("default", float(base), head_dim, max_positions, {})
    return None


def rope_spec(config: dict, head_dim: int, max_positions: int) -> RopeSpec:
    """Reads transformers 5's `rope_parameters` or the older `rope_scaling` + `rope_theta`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor={partial!r} must be a number in (0, 1] (the rotated part of a head)")
    if rope_type == "proportional":  # Gemma 4: every feature's pair, the first partial of frequencies nonzero
        params["partial_rotary_factor"] = partial
    else:
        head_dim = int(head_dim * partial)  # Phi-4-mini: the first 3/4 of each head rotate, HF's int()
    if head_dim % 2 or not head_dim:
        raise ValueError(f"partial_rotary_factor={partial} leaves a rotary width of {head_dim}, not positive and even")
    if rope_type in ("llama3", "yarn", "longrope"):  # HF: a top-level original_max_position_embeddings wins
        original = config.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original = original or params.get(
            "original_max_position_embeddings", max_positions
        )
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(f"RoPE original_max_position_embeddings={str(original)[:60]!r} must be a positive integer")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params.get(key) or ()) != head_dim // 2:
                raise ValueError(f"RoPE type 'longrope' needs {key}: {head_dim // 2} values (rotary width / 2)")
    if rope_type not in ("default", "yarn", "longrope", "proportional") and "factor" not in params:
        raise ValueError(f"RoPE type {rope_type!r} needs a `factor`")
    if rope_type == "llama3":
        _check_llama3(params)
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    _check_rope_numbers({"rope_theta": theta, **{k: params.get(k) for k in _ROPE_POSITIVE}})
    for key in ("rope_type", "type"):
        params.pop(key, None)
    return RopeSpec(rope_type, float(theta), head_dim, max_positions, params)


_ROPE_POSITIVE = ("factor", "attention_factor", "beta_fast", "beta_slow")


def _check_llama3(params: dict) -> None:
    """Llama 3's band: both factors given, positive, the low one below the high one (HF's check; equal factors
    would divide by zero in its smoothing)."""
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    _check_rope_numbers({"low_freq_factor": low, "high_freq_factor": high})
    if low is None or high is None or not low < high:
        raise ValueError(f"RoPE type 'llama3' needs low_freq_factor < high_freq_factor (got {low!r} and {high!r})")


def _check_rope_numbers(values: dict) -> None:
    """Each RoPE number a positive float32-finite one, where given: a layer kind's own rope_parameters (Gemma's,
    OLMo 3's) are read here alone, past config_checks.py's look at the top level."""
    for key, value in values.items():
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (is_number and 0 < value <= FLOAT32_MAX):
            raise ValueError(f"RoPE {key}={value!r} must be a positive number, finite in float32")
