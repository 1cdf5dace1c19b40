"""Llama-family decoder over a paged KV cache: Llama, Mistral (sliding window), Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm), tied or untied embeddings (engine-core process).

Numerics follow Hugging Face transformers (RMSNorm in fp32, rotate-half RoPE, HF's RoPE variants) so
logprobs match it. With the CPU kernels the activations, norms and KV cache are fp32 whatever the
weights' dtype: bf16 weights stay bf16 only inside the linear layers and the embedding table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionMetadata, paged_attention, write_kv
from worker.cpu.fused_decode import FusedModel, FusedStep, decode_forward, fused_model, fused_step
from worker.cpu.kernels import CpuKernels, rms_norm, rope_write_kv, silu_mul
from worker.cpu.linear import linear
from worker.models.config import LlamaArgs
from worker.models.rope import RopeSpec, cos_sin_tables

__all__ = ["LlamaArgs", "LlamaModel"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
        if kernels is not None:  # one C pass: F.rms_norm is six ops on the CPU, ~35 us for one row
            return rms_norm(kernels, x, self.weight, self.eps)[1]
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op, the same arithmetic as the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor, kernels: CpuKernels | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm of its result: (x + delta, norm(x + delta))."""
        if kernels is not None:
            return rms_norm(kernels, x, self.weight, self.eps, delta)
        total = x + delta
        return total, self(total)


class Rotary(nn.Module):
    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        cos, sin = cos_sin_tables(spec, spec.max_position_embeddings)  # [max_positions, head_dim]
        half = cos.shape[-1] // 2
        self.register_buffer("cos", cos, persistent=False)
        # rotate_half's minus folded in once: [-sin[:half], sin[half:]]
        self.register_buffer(
            "signed_sin", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False
        )

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [T, 1, D] of this step's positions, looked up once for all layers."""
        cos, signed_sin = self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)
        if cos.dtype == dtype:
            return cos, signed_sin
        return cos.to(dtype), signed_sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]. HF's x * cos + rotate_half(x) * sin, with rotate_half's minus folded into sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Fused at load time: one matmul for q/k/v and one for gate/up.
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        if args.has_qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        # Tensor parallelism: sums each layer half's partial output over the ranks (in place); None alone.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, rope: tuple, cache: torch.Tensor, meta: AttentionMetadata):
        num_tokens, a = x.shape[0], self.args
        kernels = meta.kernels
        qkv = linear(self.qkv_proj, self.input_layernorm(x, kernels), kernels)
        if a.has_qk_norm:
            qkv = self._norm_qk(qkv)
        if meta.kernels is not None:  # CPU fp32: rotation and the cache write in one call
            q, k, v = rope_write_kv(meta.kernels, qkv, *rope, meta.slot_mapping, a.num_heads, cache)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(q.view(num_tokens, a.num_heads, a.head_dim), *rope)
            k = apply_rotary(k.view(num_tokens, a.num_kv_heads, a.head_dim), *rope)
            v = v.view(num_tokens, a.num_kv_heads, a.head_dim)
            write_kv(cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, k, v, cache, meta, a.sliding_window).reshape(num_tokens, self.q_size)
        attn_out = self._sum(linear(self.o_proj, attn, kernels))
        x, normed = self.post_attention_layernorm.add_and_norm(x, attn_out, kernels)
        gate_up = linear(self.gate_up_proj, normed, kernels)
        if kernels is not None:
            return x + self._sum(linear(self.down_proj, silu_mul(kernels, gate_up), kernels))
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self._sum(linear(self.down_proj, F.silu(gate) * up))

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: this rank's part of a layer half's output -> the whole output."""
        return partial if self.all_reduce is None else self.all_reduce(partial)

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3: RMSNorm over each head of q and k (before RoPE); qkv [T, (Hq + 2 Hkv) D] stays whole."""
        num_tokens, a = qkv.shape[0], self.args
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, a.num_heads, a.head_dim)).flatten(1)
        k = self.k_norm(k.reshape(num_tokens, a.num_kv_heads, a.head_dim)).flatten(1)
        return torch.cat((q, k, v), dim=-1)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.rotary = Rotary(args.rope)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:  # one tensor, not two copies
            self.lm_head.weight = self.embed_tokens.weight
        self.cpu_kernels: CpuKernels | None = None  # set by use_cpu_kernels
        self.on_layer: Callable[[], None] | None = None  # called after each layer: the core's progress
        self._fused: FusedModel | None = None  # the model as the fused decode forward reads it
        self.can_fuse_decode = True  # False: every step op by op (tests compare the two paths)

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Runs the CPU path: fp32 activations; every parameter but the linear layers' weights and
        the embedding table widened to fp32 (norms, biases), those keep their dtype (fp32 or bf16)."""
        self.cpu_kernels = kernels
        kept = {id(self.embed_tokens.weight)}
        kept |= {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)}
        for param in self.parameters():
            if id(param) not in kept:
                param.data = param.data.float()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final-normed hidden states [T, hidden]."""
        fused = fused_step(self.cpu_kernels, meta, input_ids, positions) if self.can_fuse_decode else None
        if fused is not None and self.layers[0].all_reduce is None:  # tensor parallelism sets every layer's
            return self._fused_forward(caches, fused)
        x = self.embed_tokens(input_ids)
        if self.cpu_kernels is not None:
            x = x.float()
        rope = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, cache, meta)
            if self.on_layer is not None:
                self.on_layer()
        return self.norm(x, self.cpu_kernels)

    def _fused_forward(self, caches: list[torch.Tensor], step: FusedStep) -> torch.Tensor:
        """A few-row decode step in one C call (worker/cpu/fused_decode.py): the numbers of the path above."""
        assert self.cpu_kernels is not None
        if self._fused is None or not self._fused.is_for(caches):
            self._fused = fused_model(self, caches)
        a = self.args
        hidden = decode_forward(
            self.cpu_kernels, self._fused, step, a.hidden_size, a.rms_norm_eps, a.head_dim**-0.5
        )
        if self.on_layer is not None:
            self.on_layer()
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> logits [R, vocab] float32."""
        return linear(self.lm_head, hidden, self.cpu_kernels).float()
