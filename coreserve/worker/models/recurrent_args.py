"""The recurrent mixers' shapes read from config.json, every size checked before anything is built from it
(engine-core process): Qwen3.5's Gated DeltaNet (`linear_*` keys), LFM2's short convolution (`conv_*`) and
Granite 4.0-H's Mamba2 (`mamba_*`, with Hugging Face's defaults where absent). coreserve/worker/models/config.py
holds them in DecoderArgs; gated_deltanet.py, short_conv.py and mamba2.py compute the mixers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LinearAttentionArgs:
    """A Gated DeltaNet layer's shapes (Qwen3.5's linear_* keys): a causal depthwise conv of
    `conv_kernel` over q, k and v, then a gated delta-rule recurrence with a [key_head_dim,
    value_head_dim] state per value head (coreserve/worker/models/gated_deltanet.py)."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each q/k head serves that many value heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:  # q, k and v side by side, the conv's channels
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @property
    def state_bytes(self) -> int:
        """One sequence's state in a layer, fp32: the conv's last conv_kernel - 1 inputs and the recurrence's."""
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return 4 * (self.conv_dim * (self.conv_kernel - 1) + recurrent)


@dataclass(frozen=True)
class ShortConvArgs:
    """A short convolution layer's (LFM2's conv layers): in_proj's B, C and x, y = C * conv(B * x), a
    depthwise causal conv of `kernel` over the hidden size (coreserve/worker/models/short_conv.py)."""

    kernel: int  # conv_L_cache
    has_bias: bool  # conv_bias: in_proj, the conv and out_proj have biases

    def state_bytes(self, hidden_size: int) -> int:
        return 4 * (self.kernel - 1) * hidden_size


@dataclass(frozen=True)
class Mamba2Args:
    """in_proj gives [z | x B C | dt]; a causal depthwise conv of `conv_kernel` over x, B and C; a state
    [head_dim, state_size] a head, B and C shared by the heads of a group; the gated RMSNorm by group."""

    num_heads: int  # mamba_n_heads
    head_dim: int  # mamba_d_head ("auto": the inner width / the heads)
    num_groups: int  # mamba_n_groups, dividing the heads
    state_size: int  # mamba_d_state
    conv_kernel: int  # mamba_d_conv
    has_conv_bias: bool  # mamba_conv_bias (HF's default true)
    has_proj_bias: bool  # mamba_proj_bias: in_proj and out_proj

    @property
    def inner(self) -> int:  # x's and z's width: mamba_expand x hidden_size
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # x, B and C side by side, the conv's channels
        return self.inner + 2 * self.num_groups * self.state_size

    @property
    def state_bytes(self) -> int:
        """One sequence's state in a layer, fp32: the conv's last conv_kernel - 1 inputs and the SSM's."""
        return 4 * (self.conv_dim * (self.conv_kernel - 1) + self.inner * self.state_size)


def short_conv_args(config: dict) -> ShortConvArgs:
    kernel = config.get("conv_L_cache", 3)
    if isinstance(kernel, bool) or not isinstance(kernel, int) or not 2 <= kernel <= 64:
        raise ValueError(f"conv_L_cache={kernel!r} must be an integer in 2..64")
    return ShortConvArgs(kernel, bool(config.get("conv_bias", False)))


# linear_* key -> its largest value: a state of value heads x key_head_dim x value_head_dim floats a sequence
# and layer, and the C mixer's [value_head_dim] stack row, stay bounded (Qwen3.5: 16-64 heads of 128)
_LINEAR_KEYS = {"linear_num_key_heads": 1024, "linear_num_value_heads": 1024, "linear_key_head_dim": 1024,
                "linear_value_head_dim": 1024, "linear_conv_kernel_dim": 64}


def linear_attention_args(config: dict) -> LinearAttentionArgs:
    values = []
    for key, bound in _LINEAR_KEYS.items():
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"{key}={value!r} must be an integer in 1..{bound}")
        values.append(value)
    args = LinearAttentionArgs(*values)
    if args.num_value_heads % args.num_key_heads:
        raise ValueError(f"linear_num_value_heads={args.num_value_heads} is not a multiple of "
                         f"linear_num_key_heads={args.num_key_heads}")
    if args.conv_kernel < 2:
        raise ValueError(f"linear_conv_kernel_dim={args.conv_kernel}: the conv needs a kernel of 2 or more")
    return args


# mamba_* key -> (HF's default where absent, its largest value): a state of heads x head_dim x d_state floats
# a sequence and layer stays bounded (Granite 4.0-H: 48-128 heads of 32-64, d_state 128, one group)
_KEYS = {"mamba_n_heads": (128, 1024), "mamba_n_groups": (1, 1024), "mamba_d_state": (256, 1024),
         "mamba_d_conv": (4, 64), "mamba_expand": (2, 64)}
_MAX_HEAD_DIM = 4096


def mamba2_args(config: dict) -> Mamba2Args:
    values = {}
    for key, (default, bound) in _KEYS.items():
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"{key}={value!r} must be an integer in 1..{bound}")
        values[key] = value
    heads, groups = values["mamba_n_heads"], values["mamba_n_groups"]
    inner = values["mamba_expand"] * config["hidden_size"]
    given = config.get("mamba_d_head", "auto")
    head_dim = inner // heads if given == "auto" else given
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"mamba_d_head={given!r} must be \"auto\" or an integer in 1..{_MAX_HEAD_DIM}")
    if heads * head_dim != inner:
        raise ValueError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} must equal mamba_expand x "
                         f"hidden_size={inner}")
    if heads % groups:
        raise ValueError(f"mamba_n_heads={heads} is not a multiple of mamba_n_groups={groups}")
    if values["mamba_d_conv"] < 2:
        raise ValueError("mamba_d_conv=1: the conv needs a kernel of 2 or more")
    _check_time_step_limit(config.get("time_step_limit"))
    return Mamba2Args(heads, head_dim, groups, values["mamba_d_state"], values["mamba_d_conv"],
                      _flag(config, "mamba_conv_bias", True), _flag(config, "mamba_proj_bias", False))


def _flag(config: dict, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):  # "false" would read as true
        raise ValueError(f"{key}={value!r} must be true or false")
    return value


def _check_time_step_limit(limit: object) -> None:
    """HF clamps dt to time_step_limit in its prompt path only, not when decoding: a limit that clamps
    anything (above 0 from below, finite from above; dt = softplus(...) is never negative) is refused."""
    if limit is None:
        return
    is_pair = isinstance(limit, (list, tuple)) and len(limit) == 2
    low, high = (_number(v) for v in limit) if is_pair else (None, None)
    if low is None or high is None or not low <= 0 or high != math.inf:
        raise ValueError(f"time_step_limit={limit!r} is not supported: only (0.0, inf), which clamps nothing")


def _number(value: object) -> float | None:
    """A JSON number, or transformers' {"__float__": "Infinity"} for an infinity; None: neither."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
        return float(value) if value in ("Infinity", "-Infinity", "NaN") else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
