"""The model's ops on the C kernels (engine-core process): fp32 activations, norms and KV cache;
bf16 weights stay bf16 only inside the linear layers and the embedding table.

`apply_cpu_backend` hands a loaded model to these ops, once, from outside the model: the norms' and
biases' parameters widened to fp32, `model.ops` set. `CpuBackend` (backend.py) calls it, and makes
the attention plan (attention_plan.py) these ops read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from coreserve.worker.cpu.attention_plan import CpuAttentionPlan, KernelRows
from coreserve.worker.cpu.bindings import CpuKernels
from coreserve.worker.cpu.kernels import (
    decode_attention,
    gated_deltanet,
    mamba2,
    rms_norm,
    rope_write_kv,
    sigmoid,
    silu_mul,
)
from coreserve.worker.cpu.linear import linear
from coreserve.worker.models.gated_deltanet import LayerState
from coreserve.worker.models.ops import HeadShape, Rope, TorchOps, clamped_swiglu, gelu_tanh_mul
from coreserve.worker.models.short_conv import short_conv
from coreserve.worker.step.attention import AttentionMetadata, AttentionSpec, StateSpan, paged_attention


def _whole(partial: torch.Tensor) -> torch.Tensor:
    return partial  # one process holds the whole layer


_TORCH = TorchOps()  # torch's rope_write_kv, for the partial rotary and NoPE the C kernel does not do


class CpuOps:
    """`is_batch_invariant`: every product on gemv.c, and prefill tokens attended by the decode kernel
    over their causal prefix (the plan's every_token rows), so a token's numbers are the same in any
    batch, chunk or step (docs/decisions.md)."""

    def __init__(self, kernels: CpuKernels, is_batch_invariant: bool = False, is_int8: bool = False) -> None:
        self.kernels = kernels
        self.is_batch_invariant = is_batch_invariant
        self.is_int8 = is_int8  # integer mode's products for GGUF blocks (quant_linear.py)
        self.sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] = _whole

    def embed(self, table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        return table(input_ids).float()

    def rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.kernels, x, _scale(norm), norm.eps)[1]  # one C pass, not six torch ops

    def add_rms_norm(
        self, norm: nn.Module, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(self.kernels, x, _scale(norm), norm.eps, delta)

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(layer, x, self.kernels, self.is_batch_invariant, self.is_int8)

    def rope_write_kv(
        self, qkv: torch.Tensor, rope: Rope | None, slots: torch.Tensor, shape: HeadShape, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if rope is None or rope[0].shape[-1] < shape.head_dim:  # NoPE, partial rotary: torch's, then the C attention
            q, k, v = _TORCH.rope_write_kv(qkv, rope, slots, shape, cache)
            return q.contiguous(), k, v
        return rope_write_kv(self.kernels, qkv, *rope, slots, shape.num_heads, cache)  # one call

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(self.kernels, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_mul(gate_up)  # torch's, element-wise (Gemma alone uses it)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return sigmoid(self.kernels, x)

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return clamped_swiglu(gate_up, alpha, limit, self.sigmoid)  # the sigmoid in C: a row's bits in any batch

    def gated_deltanet(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor:
        """csrc/recurrent_mixers.c, a call a sequence: its numbers never depend on the others'."""
        return gated_deltanet(self.kernels, mixer, proj, state, spans)

    def short_conv(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor:
        """torch's: products and sums element by element, the same bits in any batch (short_conv.py)."""
        return short_conv(mixer, proj, state, spans)

    def mamba2(
        self, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans: list[StateSpan]
    ) -> torch.Tensor:
        """csrc/recurrent_mixers.c, a call a sequence: its numbers never depend on the others'."""
        return mamba2(self.kernels, mixer, proj, state, spans)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
        meta: AttentionMetadata, spec: AttentionSpec, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.is_batch_invariant or not spec.is_causal:  # bidirectional: a whole prompt, one request a call
            return paged_attention(q, k, v, cache, meta, spec, self._attend_decode, sinks)
        out = torch.empty_like(q)  # this step's k and v are in the cache already (rope_write_kv)
        self._attend_rows(q, out, cache, _plan(meta).every_token, spec, sinks)
        return out

    def _attend_decode(
        self, q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, spec: AttentionSpec,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self._attend_rows(q, out, cache, _plan(meta).decode, spec, sinks)

    def _attend_rows(
        self, q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor, rows: KernelRows | None, spec: AttentionSpec,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """The C kernel reads the spec's fields as its arguments: scale, window (0: none), softcap (0: none);
        and the layer's sinks (gpt-oss; fp32, as apply_cpu_backend widened them)."""
        assert rows is not None
        r = rows.rows
        decode_attention(
            self.kernels, q, out, cache, r.rows, r.block_tables, r.context_lens, r.block_size,
            q.shape[2] ** -0.5 if spec.scale is None else spec.scale, spec.window or 0, rows.pointers,
            spec.softcap or 0.0, sinks,
        )


def _scale(norm: nn.Module) -> torch.Tensor:
    """A norm's multiplier: its weight, or Gemma's 1 + weight (in fp32, as HF computes it)."""
    return norm.weight if not getattr(norm, "offset", 0.0) else norm.weight.float() + norm.offset


def _plan(meta: AttentionMetadata) -> CpuAttentionPlan:
    assert isinstance(meta.plan, CpuAttentionPlan), "the C kernels read CpuBackend's plan (prepare)"
    return meta.plan


def apply_cpu_backend(
    model: nn.Module, kernels: CpuKernels, is_batch_invariant: bool = False, is_int8: bool = False
) -> None:
    """Every parameter but the linear layers' weights and the embedding table widened to fp32 (norms,
    biases); those keep their dtype (fp32 or bf16). Then the model runs on `CpuOps`."""
    kept = {id(model.embed_tokens.weight)}
    kept |= {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    for param in model.parameters():
        if id(param) not in kept:
            param.data = param.data.float()
    model.ops = CpuOps(kernels, is_batch_invariant, is_int8)
