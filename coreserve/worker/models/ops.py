"""The ops a decoder layer is written in, and torch's implementation of them (engine-core process).

The model (coreserve/worker/models/decoder.py) calls `model.ops.<op>` and never asks which backend runs: the
ops object is chosen once, when the model is loaded (`TorchOps`, torch's ops in the weights' dtype:
CUDA, or the CPU without a compiler) or handed to a backend afterwards (coreserve/worker/cpu/ops.py's
`CpuOps`; coreserve/worker/models/sharding.py's `apply_tp` sets `sum_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from coreserve.worker.models.gated_deltanet import LayerState, each_sequence, gated_deltanet_span
from coreserve.worker.models.mamba2 import mamba2
from coreserve.worker.models.short_conv import short_conv
from coreserve.worker.step.attention import (
    AttentionMetadata,
    AttentionSpec,
    StateSpan,
    decode_attention_torch,
    paged_attention,
    write_kv,
)


@dataclass(frozen=True)
class HeadShape:
    num_heads: int  # query heads (this rank's under tensor parallelism)
    num_kv_heads: int
    head_dim: int


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sign-folded sin [T, 1, D] of this step's positions


class ModelOps(Protocol):
    """What a backend gives the model. Norm modules carry `weight` [hidden] and `eps`."""

    def embed(self, table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor: ...  # [T] -> [T, hidden]
    def rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor: ...
    def add_rms_norm(
        self, norm: nn.Module, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (x + delta, norm(x + delta))
    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor: ...  # [T, in] -> [T, out]
    def rope_write_kv(
        self, qkv: torch.Tensor, rope: Rope | None, slots: torch.Tensor, shape: HeadShape, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...  # q [T, Hq, D], k and v [T, Hkv, D]; None: NoPE
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...  # [T, 2 I] -> [T, I]
    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...  # Gemma's GeGLU, [T, 2 I] -> [T, I]
    def sigmoid(self, x: torch.Tensor) -> torch.Tensor: ...  # element-wise, x's shape
    def clamped_swiglu(
        self, gate_up: torch.Tensor, alpha: float, limit: float
    ) -> torch.Tensor: ...  # gpt-oss's experts, [T, 2 I] -> [T, I]
    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
        meta: AttentionMetadata, spec: AttentionSpec, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...  # q [T, Hq, D], k and v [T, Hkv, D] (in the cache already), sinks [Hq] -> [T, Hq, D]
    def gated_deltanet(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor: ...  # in_proj's rows [T, width] -> [T, value_dim], each span from its state slot
    def short_conv(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor: ...  # in_proj's rows [T, 3 hidden] -> [T, hidden] (LFM2)
    def mamba2(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor: ...  # in_proj's rows [T, width] -> [T, inner] (Granite 4.0-H)
    # [T, hidden] partial output of a layer half -> the whole: the sum over tensor-parallel ranks
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]. HF's x * cos + rotate_half(x) * sin, with rotate_half's minus folded into sin.
    Tables narrower than D (partial rotary, Phi-4-mini): the first R features rotate, the rest pass."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :width], cos, signed_sin), x[..., width:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def _whole(partial: torch.Tensor) -> torch.Tensor:
    return partial  # one process holds the whole layer


class TorchOps:
    """torch's ops, activations in the weights' dtype."""

    def __init__(self) -> None:
        self.sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] = _whole

    def embed(self, table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        return table(input_ids)

    def rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(
        self, norm: nn.Module, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + delta
        return total, norm(total)

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def rope_write_kv(
        self, qkv: torch.Tensor, rope: Rope | None, slots: torch.Tensor, shape: HeadShape, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, q_size = qkv.shape[0], shape.num_heads * shape.head_dim
        kv_size = shape.num_kv_heads * shape.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, shape.num_heads, shape.head_dim)
        k = k.reshape(num_tokens, shape.num_kv_heads, shape.head_dim)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        v = v.view(num_tokens, shape.num_kv_heads, shape.head_dim)
        write_kv(cache, k, v, slots)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_mul(gate_up)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return clamped_swiglu(gate_up, alpha, limit)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
        meta: AttentionMetadata, spec: AttentionSpec, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention(q, k, v, cache, meta, spec, decode_attention_torch, sinks)

    def gated_deltanet(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor:
        return each_sequence(gated_deltanet_span, mixer, proj, state, spans, mixer.value_dim).to(proj.dtype)

    def short_conv(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor:
        return short_conv(mixer, proj, state, spans).to(proj.dtype)

    def mamba2(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor:
        return mamba2(mixer, proj, state, spans).to(proj.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with HF's gelu_pytorch_tanh: element-wise, so a row's numbers never depend on the batch."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(
    gate_up: torch.Tensor, alpha: float, limit: float,
    sigmoid: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid,
) -> torch.Tensor:
    """gpt-oss's expert activation as HF computes it, on [gate | up] halves (the checkpoint's interleaved
    columns are put in halves at load): the gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) gate sigmoid(alpha gate). Clamps, products and sums are exactly rounded element by element;
    `sigmoid` is the backend's (the CPU's in C: torch's vector loop and its scalar tail differ in bits)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * sigmoid(gate * alpha))
