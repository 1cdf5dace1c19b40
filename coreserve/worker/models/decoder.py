"""The decoder over a paged KV cache for every family of coreserve/worker/models/family.py: one layer body
that reads its layer's frozen spec (coreserve/worker/models/layer_spec.py: norms and their offset, the sandwich
or norms on the outputs only, q/k norms, attention's window, scale and soft-cap, its RoPE table or none, GeGLU or
SwiGLU, experts from coreserve/worker/models/moe.py or a dense MLP, a recurrent mixer in place of attention,
Granite's multipliers, Gemma 4's norm on v and layer scalar), tied or untied embeddings (engine-core process).

The one statement of the model's math. Every op goes through `self.ops` (coreserve/worker/models/ops.py),
chosen once outside the model: torch's, or the CPU backend's (fp32 activations, norms and KV cache
whatever the weights' dtype). Numerics follow Hugging Face transformers (RMSNorm in fp32,
rotate-half RoPE, HF's RoPE variants) so logprobs match it. `weights()` names the tensors by role,
for the readers of the model that are not torch (the fused decode forward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.family import GATED_DELTANET, MAMBA2, SHORT_CONV, SILU
from coreserve.worker.models.gated_deltanet import GatedDeltaNet, LayerState
from coreserve.worker.models.mamba2 import Mamba2
from coreserve.worker.models.moe import SparseMoe
from coreserve.worker.models.ops import HeadShape, ModelOps, Rope, TorchOps
from coreserve.worker.models.rope import Rotary
from coreserve.worker.models.short_conv import ShortConv
from coreserve.worker.step.attention import AttentionMetadata
from coreserve.worker.step.hidden_keep import HiddenKeep

__all__ = ["DecoderArgs", "DecoderModel"]


class RMSNorm(nn.Module):
    """`offset` 1: Gemma's, normalised and scaled by 1 + weight in fp32, then cast to x's dtype."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.offset:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        if dtype == torch.float32:  # one fused op, the same arithmetic as the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class LayerWeights(NamedTuple):
    """A decoder layer's tensors by role; a missing bias or norm is None."""

    input_norm: torch.Tensor | None  # [hidden]; None: norms on the outputs only (OLMo 2/3, Exaone 4)
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    q_norm: torch.Tensor | None  # [D] Qwen3 ([Hq D] OLMoE)
    k_norm: torch.Tensor | None  # [D] Qwen3 ([Hkv D] OLMoE)
    o: torch.Tensor  # [hidden, Hq D]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # [2 I, hidden]; None: a mixture of experts
    down: torch.Tensor | None  # [hidden, I]


class ModelWeights(NamedTuple):
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    cos: torch.Tensor  # [rows, D / 2] float32, the half HF's [rows, D] repeats (Rotary's rows)
    sin: torch.Tensor  # [rows, D / 2] float32
    layers: list[LayerWeights]
    lm_head: torch.Tensor | None = None  # [vocab, hidden]: floats or GGUF blocks (the embedding's where tied)
    lm_head_bias: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    """One body for every family: what differs (norms and their offset, the sandwich or the outputs' norms alone,
    q/k norms, attention's window, scale and soft-cap, GeGLU or SwiGLU, experts or dense, a recurrent mixer,
    Granite's residual multiplier) is read from the layer's frozen spec
    (coreserve/worker/models/layer_spec.py)."""

    def __init__(self, args: DecoderArgs, index: int = 0) -> None:
        super().__init__()
        self.args, self.spec = args, args.layers[index]
        spec, eps, hidden = self.spec, args.rms_norm_eps, args.hidden_size
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        if spec.has_pre_norms:  # OLMo 2/3, Exaone 4: norms on the outputs only
            self.input_layernorm = RMSNorm(hidden, eps, spec.norm_offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, spec.norm_offset)
        if spec.has_sandwich_norms:  # post_attention_layernorm is then on the attention's output
            if spec.has_pre_norms:
                self.pre_feedforward_layernorm = RMSNorm(hidden, eps, spec.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, spec.norm_offset)
        # A recurrent mixer in place of attention (Qwen3.5's linear_attention layers, LFM2's conv layers,
        # Granite's mamba layers): no q/k/v, no KV cache, a state slot a sequence
        self.linear_attn = GatedDeltaNet(args) if spec.mixer == GATED_DELTANET else None
        self.conv = ShortConv(args) if spec.mixer == SHORT_CONV else None
        self.mamba = Mamba2(args) if spec.mixer == MAMBA2 else None
        self.moe = SparseMoe(args) if spec.is_moe else None
        self.routed: torch.Tensor | None = None  # a mixture's last step: each token's experts [T, top_k]
        if self.moe is None:
            self.gate_up_proj = nn.Linear(hidden, 2 * args.intermediate_size, bias=False)
            self.down_proj = nn.Linear(args.intermediate_size, hidden, bias=False)
        if spec.mixer == "attention":
            self._add_attention(args)
        if spec.has_layer_scalar:  # Gemma 4: the layer's output times it, a tensor of the checkpoint
            self.layer_scalar = nn.Parameter(torch.ones(1))
        self.heads = HeadShape(args.num_heads, args.num_kv_heads, args.head_dim)

    def _add_attention(self, args: DecoderArgs) -> None:
        """q/k/v fused at load time into one product (and gate/up into another); an output gate (Qwen3.5)
        is q_proj's second half of each head: q_proj then holds [q_h | gate_h] a head."""
        spec, eps, hidden = self.spec, args.rms_norm_eps, args.hidden_size
        q_rows = 2 * self.q_size if spec.has_output_gate else self.q_size
        self.qkv_proj = nn.Linear(hidden, q_rows + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=args.o_bias)
        if spec.has_sinks:  # gpt-oss: a logit a head that joins its softmax
            self.sinks = nn.Parameter(torch.empty(args.num_heads))
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(args.head_dim, eps, spec.norm_offset)
            self.k_norm = RMSNorm(args.head_dim, eps, spec.norm_offset)
        elif spec.qk_norm == "whole":
            self.q_norm = RMSNorm(self.q_size, eps, spec.norm_offset)
            self.k_norm = RMSNorm(self.kv_size, eps, spec.norm_offset)

    def forward(
        self, x: torch.Tensor, rope: Rope | None, cache: torch.Tensor | LayerState, meta: AttentionMetadata,
        ops: ModelOps,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; this step's K and V written to `cache` (a recurrent layer's
        cache: its state slots, each sequence's advanced by its tokens)."""
        spec = self.spec
        normed = ops.rms_norm(self.input_layernorm, x) if spec.has_pre_norms else x
        if spec.mixer == "attention":
            attn_out = ops.sum_over_ranks(self._attention(normed, rope, cache, meta, ops))
        else:
            attn_out = self._recurrent(normed, cache, meta, ops)
        if spec.residual_multiplier is not None:  # Granite: residual + out * multiplier, as HF
            attn_out = attn_out * spec.residual_multiplier
        pre_mlp_norm = self.post_attention_layernorm
        if spec.has_sandwich_norms:
            attn_out = ops.rms_norm(self.post_attention_layernorm, attn_out)
            pre_mlp_norm = self.pre_feedforward_layernorm if spec.has_pre_norms else None
        if pre_mlp_norm is None:  # the MLP reads the residual stream as it is (OLMo 2/3, Exaone 4)
            x = normed = x + attn_out
        else:
            x, normed = ops.add_rms_norm(pre_mlp_norm, x, attn_out)
        mlp_out = ops.sum_over_ranks(self._mlp(normed, ops))
        if spec.has_sandwich_norms:
            mlp_out = ops.rms_norm(self.post_feedforward_layernorm, mlp_out)
        if spec.residual_multiplier is not None:
            mlp_out = mlp_out * spec.residual_multiplier
        return x + mlp_out if not spec.has_layer_scalar else (x + mlp_out) * self.layer_scalar

    def _recurrent(
        self, normed: torch.Tensor, cache: LayerState, meta: AttentionMetadata, ops: ModelOps
    ) -> torch.Tensor:
        """normed [T, hidden] -> in_proj, the mixer over each sequence of the step from its state slot,
        out_proj: [T, hidden]."""
        mixer = self.linear_attn or self.conv or self.mamba
        mix = {GATED_DELTANET: ops.gated_deltanet, SHORT_CONV: ops.short_conv, MAMBA2: ops.mamba2}[self.spec.mixer]
        return ops.linear(mixer.out_proj, mix(mixer, ops.linear(mixer.in_proj, normed), cache, meta.state_spans))

    def _attention(
        self, normed: torch.Tensor, rope: Rope | None, cache: torch.Tensor, meta: AttentionMetadata,
        ops: ModelOps,
    ) -> torch.Tensor:
        """normed [T, hidden] -> this rank's partial attention output [T, hidden]."""
        spec, num_tokens = self.spec, normed.shape[0]
        qkv = ops.linear(self.qkv_proj, normed)
        gate = None
        if spec.has_output_gate:  # [q_h | gate_h] a head, then k and v
            q_gate, kv = qkv.split([2 * self.q_size, 2 * self.kv_size], dim=-1)
            q_gate = q_gate.reshape(num_tokens, self.heads.num_heads, 2, self.heads.head_dim)
            gate = q_gate[:, :, 1].reshape(num_tokens, self.q_size)
            qkv = torch.cat((q_gate[:, :, 0].reshape(num_tokens, self.q_size), kv), dim=-1)
        if spec.qk_norm is not None:
            qkv = self._norm_qk(qkv, ops)
        if spec.clip_qkv is not None:
            qkv = qkv.clamp(-spec.clip_qkv, spec.clip_qkv)
        q, k, v = ops.rope_write_kv(qkv, rope, meta.slot_mapping, self.heads, cache)
        sinks = self.sinks if spec.has_sinks else None
        attn = ops.attention(q, k, v, cache, meta, spec.attention, sinks).reshape(num_tokens, self.q_size)
        if gate is not None:  # the ops' sigmoid: torch's rounds an element by where it falls in its vector loop
            attn = attn * ops.sigmoid(gate)
        return ops.linear(self.o_proj, attn)

    def _mlp(self, normed: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        """normed [T, hidden] -> this rank's partial MLP output [T, hidden]: the experts', or the gated
        MLP's with the spec's activation."""
        if self.moe is not None:
            mlp_out, self.routed = self.moe(normed, ops)
            return mlp_out
        gate_up = ops.linear(self.gate_up_proj, normed)
        hidden = ops.silu_mul(gate_up) if self.spec.activation == SILU else ops.gelu_tanh_mul(gate_up)
        return ops.linear(self.down_proj, hidden)

    def weights(self) -> LayerWeights:
        has_qk_norm = self.spec.qk_norm is not None
        dense = self.moe is None
        return LayerWeights(
            self.input_layernorm.weight if self.spec.has_pre_norms else None, self.qkv_proj.weight,
            self.qkv_proj.bias,
            self.q_norm.weight if has_qk_norm else None, self.k_norm.weight if has_qk_norm else None,
            self.o_proj.weight, self.o_proj.bias, self.post_attention_layernorm.weight,
            self.gate_up_proj.weight if dense else None, self.down_proj.weight if dense else None,
        )

    def _norm_qk(self, qkv: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        """Qwen3: RMSNorm over each head of q and k (OLMoE, OLMo 2/3: over all of q and all of k, torch's), before
        RoPE; Gemma 4: each head of v too, without a weight, in fp32 as HF (its pow(mean + eps, -0.5)). qkv
        [T, (Hq + 2 Hkv) D] stays whole. The per-head norms are the ops', a row [T H, D] a head: the fused decode
        forward norms each head with the same C, so a token's bits do not depend on which path its step took."""
        num_tokens, a = qkv.shape[0], self.args
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.spec.qk_norm == "whole":
            return torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        q = ops.rms_norm(self.q_norm, q.reshape(num_tokens * a.num_heads, a.head_dim).contiguous())
        k = ops.rms_norm(self.k_norm, k.reshape(num_tokens * a.num_kv_heads, a.head_dim).contiguous())
        if self.spec.has_v_norm:
            heads = v.reshape(num_tokens, a.num_kv_heads, a.head_dim).float()
            v = (heads * torch.pow(heads.pow(2).mean(-1, keepdim=True) + a.rms_norm_eps, -0.5)).to(v.dtype).flatten(1)
        return torch.cat((q.view(num_tokens, -1), k.view(num_tokens, -1), v), dim=-1)


class DecoderModel(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.rotary = Rotary(args.rope)
        # a second table where some layers have their own RoPE (Gemma 3's sliding layers)
        self.uses_local_rope = [spec.rope != args.rope for spec in args.layers[: args.num_layers]]
        local = [spec.rope for spec, is_local in zip(args.layers, self.uses_local_rope) if is_local]
        self.rotary_local = Rotary(local[0]) if local else None
        # Given its (uninitialised) table: every weight is read from the checkpoint, and the default
        # init's normal_ on a meta-device model first imports torch._dynamo (seconds).
        table = torch.empty(args.vocab_size, args.hidden_size)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:  # one tensor, not two copies
            self.lm_head.weight = self.embed_tokens.weight
        if args.num_labels:  # a *ForSequenceClassification's head (coreserve/worker/pooling/pooler.py reads it)
            self.score = nn.Linear(args.hidden_size, args.num_labels, bias=False)
        self.ops: ModelOps = TorchOps()  # a backend's ops replace these (coreserve/worker/cpu/ops.py)
        # The last forward's kept hidden states (its `keep`): HF index -> [kept rows, hidden]
        self.kept_states: dict[int, torch.Tensor] = {}

    def forward(
        self,
        input_ids: torch.Tensor,
        rope_rows: torch.Tensor,
        caches: list[torch.Tensor],
        meta: AttentionMetadata,
        on_layer: Callable[[], None] | None = None,
        keep: HiddenKeep | None = None,
    ) -> torch.Tensor:
        """input_ids, rope_rows (each token's row of the RoPE tables: StepInputs'): [T]. Returns the
        final-normed hidden states [T, hidden]. `on_layer`: called after each layer (the engine counts
        it as progress); `keep`: the HF indices below L and the rows whose states `kept_states` holds
        after it (the embedding output is index 0, layer i's output index i + 1)."""
        ops, embed_scale = self.ops, self.args.embed_scale
        self.kept_states = {}
        x = ops.embed(self.embed_tokens, input_ids)
        if self.args.embedding_multiplier is not None:  # Granite: a Python float, as HF multiplies
            x = x * self.args.embedding_multiplier
        if embed_scale is not None:  # HF's normalizer: sqrt(hidden) rounded to the weights' dtype; a table
            table = self.embed_tokens.weight  # kept in GGUF blocks is uint8 storage: its values are x's dtype
            dtype = table.dtype if table.is_floating_point() else x.dtype
            x = x * torch.tensor(embed_scale, dtype=dtype).to(x.dtype)
        rope = self.rotary.tables(rope_rows, x.dtype)
        rope_local = rope if self.rotary_local is None else self.rotary_local.tables(rope_rows, x.dtype)
        self._keep(keep, 0, x)
        for index, (layer, cache, is_local) in enumerate(zip(self.layers, caches, self.uses_local_rope)):
            x = layer(x, rope_local if is_local else rope, cache, meta, ops)
            self._keep(keep, index + 1, x)
            if on_layer is not None:
                on_layer()
        return ops.rms_norm(self.norm, x)

    def _keep(self, keep: HiddenKeep | None, index: int, x: torch.Tensor) -> None:
        """HF's hidden state `index` at the kept rows (a copy: no layer writes into a tensor it was given,
        and the step's [T, hidden] tensors are not held past their layer)."""
        if keep is not None and index in keep.layers:
            self.kept_states[index] = x.index_select(0, keep.rows)

    def routed_experts(self) -> torch.Tensor | None:
        """The last forward's routed experts [T, MoE layers, top_k] int16 (most probable first); None:
        not a mixture of experts."""
        routed = [layer.routed for layer in self.layers if layer.moe is not None]
        return torch.stack(routed, dim=1).to(torch.int16) if routed else None

    def weights(self) -> ModelWeights:
        return ModelWeights(
            self.embed_tokens.weight,
            self.norm.weight,
            self.rotary.cos,
            self.rotary.sin,
            [layer.weights() for layer in self.layers],
            self.lm_head.weight,
            self.lm_head.bias,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> logits [R, vocab] float32 (Gemma 2: soft-capped, cap tanh(logit / cap); Granite:
        divided by logits_scaling in the logits' dtype, as HF)."""
        logits = self.ops.linear(self.lm_head, hidden)
        if self.args.logits_scaling is not None:
            logits = logits.div_(self.args.logits_scaling)  # in place: no [R, vocab] copy
        logits, cap = logits.float(), self.args.final_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)  # in place: no [R, vocab] copies
