"""RoPE variants as Hugging Face transformers computes them: inverse frequencies and the attention
scaling of cos/sin, for `default`, `linear`, `dynamic`, `llama3`, `yarn`, `longrope` and `proportional`
(Gemma 4's global layers: the first partial_rotary_factor of a whole head's frequencies, the rest zero, so
their features pass unrotated) (engine-core process).

Each function repeats HF's float32 arithmetic step for step (transformers' `modeling_rope_utils`), so
the cos/sin tables are the same bits as HF's. `dynamic` (NTK) is HF's static case: HF recomputes the
frequencies only for sequences longer than `max_position_embeddings`, which this engine never runs
(max_model_len is capped there), so below it the frequencies are the default ones. `longrope`'s
tables hold both of its sets of rows; which one a request's tokens read is the scheduler's choice, by
the request's length (coreserve/engine_core/scheduler.py). `Rotary` holds a model's tables (half of each
row, as HF's repeat) and looks up a step's rows; NoPE (`NO_ROPE`, Granite 4.0-H) has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")
NO_ROPE = "none"  # no rotation at all (Granite 4.0-H's NoPE): no tables, q and k attend as they are


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    head_dim: int
    max_position_embeddings: int
    params: dict = field(default_factory=dict)  # the config's rope parameters (factor, ...)


def rope_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """Returns inv_freq [head_dim / 2] float32 and the factor HF multiplies cos and sin by."""
    if spec.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {spec.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    inv_freq = _default_inv_freq(spec.theta, spec.head_dim)
    if spec.rope_type == "linear":
        return inv_freq / spec.params["factor"], 1.0
    if spec.rope_type == "llama3":
        return _llama3(inv_freq, spec.params), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec)
    if spec.rope_type == "longrope":
        return _longrope(spec, "short_factor")
    if spec.rope_type == "proportional":  # HF's int(partial * head_dim // 2) frequencies kept, over head_dim
        num_rotated = int(spec.params["partial_rotary_factor"] * spec.head_dim // 2)
        inv_freq[num_rotated:] = 0.0
        return inv_freq / spec.params.get("factor", 1.0), 1.0
    return inv_freq, 1.0  # default, and dynamic up to max_position_embeddings


def long_rope_switch(spec: RopeSpec) -> int | None:
    """LongRoPE's switch: a sequence longer than this many tokens rotates every position with the long
    factors, one up to it with the short ones (HF's `seq_len > original_max_position_embeddings`);
    None for every other RoPE type."""
    return spec.params["original_max_position_embeddings"] if spec.rope_type == "longrope" else None


def long_rows_start(spec: RopeSpec, num_positions: int) -> int:
    """The row of position 0 in the long factors' part of cos_sin_tables' tables (0: one part)."""
    switch = long_rope_switch(spec)
    return 0 if switch is None else min(switch, num_positions)


def cos_sin_tables(spec: RopeSpec, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows, head_dim] float32, scaled as HF scales them: a row per position. LongRoPE has
    two parts, the short factors' rows of the positions below the switch, then the long factors' rows
    of every position, from long_rows_start: a sequence takes one part for all its positions, as HF
    chooses one set of frequencies for a whole forward (docs/models.md)."""
    freqs, scaling = _table_angles(spec, num_positions)
    return _cos_sin(freqs, scaling)


def _table_angles(spec: RopeSpec, num_positions: int) -> tuple[torch.Tensor, float]:
    """The tables' angles [rows, head_dim / 2] (LongRoPE's two parts) and HF's scaling of cos and sin."""
    inv_freq, scaling = rope_frequencies(spec)
    if spec.rope_type == "longrope":
        long_inv_freq, _ = _longrope(spec, "long_factor")
        short = _angles(inv_freq, long_rows_start(spec, num_positions))
        return torch.cat((short, _angles(long_inv_freq, num_positions))), scaling
    return _angles(inv_freq, num_positions), scaling


def _cos_sin(freqs: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos and sin of [freqs, freqs] (the full head width), scaled."""
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def _angles(inv_freq: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[num_positions, head_dim / 2] float32 position * inv_freq, HF's product."""
    return torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]


def _longrope(spec: RopeSpec, factors: str) -> tuple[torch.Tensor, float]:
    """LongRoPE's inverse frequencies with its short or long factors, and its attention factor (from
    max_position_embeddings / original_max_position_embeddings where `factor` is not given, as Phi-3)."""
    params, dim = spec.params, spec.head_dim
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or spec.max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    ext_factors = torch.tensor(params[factors], dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * spec.theta**inv_freq_shape), attention_factor


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor, old_context_len = params["factor"], params["original_max_position_embeddings"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    params, base, dim = spec.params, spec.theta, spec.head_dim
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or spec.max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    low, high = _yarn_correction_range(
        beta_fast, beta_slow, dim, base, original_max, params.get("truncate", True)
    )
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation, inv_freq_interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


def _yarn_correction_range(
    low_rot: float, high_rot: float, dim: int, base: float, max_positions: int, truncate: bool
) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(low_rot), correction_dim(high_rot)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


# Rows whose full-width cos and sin are computed at once: whole, they took 4.5 times the kept tables' memory
# (580 MiB at load for a 2^20-position table of D 32, what a granitehybrid GGUF with RoPE states)
_CHUNK_ROWS = 1 << 16


class Rotary(nn.Module):
    """HF's cos and sin tables [max_positions, D] repeat their first half ([freqs, freqs]), so only that
    half is kept: 1 MiB each, not 2, for 8192 positions of D 64 (issue 25's memory at load), computed a
    chunk of rows at a time. LongRoPE's have a row per position of its long factors after the short ones'
    (from `long_rows_start`). NoPE (`NO_ROPE`): no tables, and q and k are not rotated."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.long_rows_start = long_rows_start(spec, spec.max_position_embeddings)
        self.is_identity = spec.rope_type == NO_ROPE
        # On the CPU even within a meta-device model (the loader's): meta arithmetic first imports
        # torch._dynamo (seconds); the loader keeps these tables and moves them to the model's device.
        with torch.device("cpu"):
            rows = 0 if self.is_identity else spec.max_position_embeddings
            freqs, scaling = _table_angles(spec, rows) if rows else (torch.empty(0, 1), 1.0)
            if not torch.isfinite(freqs).all():  # a base far below 1 (1e-45): frequencies past float32
                raise ValueError(f"RoPE base rope_theta={spec.theta!r} ({spec.rope_type}; a layer kind's own base "
                                 "included) gives angles past float32: a base far below 1")
            cos, sin = torch.empty(freqs.shape), torch.empty(freqs.shape)
            for start in range(0, freqs.shape[0], _CHUNK_ROWS):
                _keep_half(freqs[start : start + _CHUNK_ROWS], scaling, cos[start:], sin[start:])
        self.register_buffer("cos", cos, persistent=False)  # [rows, D / 2]
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, rope_rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sign-folded sin [T, 1, D] of this step's rows (StepInputs.rope_rows), looked up once
        for all layers: [cos, cos] and rotate_half's minus folded in, [-sin, sin]; None: NoPE."""
        if self.is_identity:
            return None
        cos, sin = self.cos[rope_rows].unsqueeze(1), self.sin[rope_rows].unsqueeze(1)
        cos, signed_sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        if cos.dtype == dtype:
            return cos, signed_sin
        return cos.to(dtype), signed_sin.to(dtype)


def _keep_half(freqs: torch.Tensor, scaling: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The first half of each full-width row of `freqs`' cos and sin (computed as HF computes them) into
    the first rows of `cos` and `sin`; its halves are the same values, checked."""
    full_cos, full_sin = _cos_sin(freqs, scaling)
    half, n = freqs.shape[-1], freqs.shape[0]
    halves_equal = all(torch.equal(full[:, :half], full[:, half:]) for full in (full_cos, full_sin))
    if not halves_equal:
        raise RuntimeError("RoPE tables whose halves differ: half-width tables would change the bits")
    cos[:n], sin[:n] = full_cos[:, :half], full_sin[:, :half]
