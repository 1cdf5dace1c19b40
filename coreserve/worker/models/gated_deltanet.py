"""The Gated DeltaNet mixer of Qwen3.5's linear_attention layers (engine-core process): a recurrent state
a sequence in place of a KV cache (coreserve/worker/kv_memory.py's state slots).

Its input projection is one product ([q k v | z | b | a], HF's four fused at load), then, sequence by
sequence, `ops.gated_deltanet` (the CPU's: csrc/recurrent_mixers.c; torch's: `gated_deltanet_span`
below): the causal conv from the sequence's conv state, the gated delta rule token by token from its
recurrent state, each value head normed and gated by silu(z); then out_proj. Token by token for a
prompt as for decoding: the one order, so that scoring a sequence gives the bits of generating it
(HF computes a prompt in chunks: the same numbers within rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from coreserve.worker.models.config import DecoderArgs, LinearAttentionArgs


class LayerState(NamedTuple):
    """A recurrent layer's state cache, a slot a running sequence, fp32."""

    conv: torch.Tensor  # [slots, conv_kernel - 1, conv_dim], the last inputs, oldest first
    # [slots, value heads, key_head_dim, value_head_dim] (Mamba2's: [slots, heads, head_dim, d_state]); None:
    # a short conv's
    recurrent: torch.Tensor | None


class GatedDeltaNet(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        assert args.linear is not None
        self.shape: LinearAttentionArgs = args.linear
        lin = self.shape
        self.value_dim = lin.num_value_heads * lin.value_head_dim
        width = lin.conv_dim + self.value_dim + 2 * lin.num_value_heads  # [q k v | z | b | a]
        self.in_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(lin.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(lin.num_value_heads))
        self.norm = nn.Module()  # HF's gated RMSNorm: weight, no offset
        self.norm.weight = nn.Parameter(torch.empty(lin.value_head_dim))
        self.eps = args.rms_norm_eps
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)


def gated_deltanet_span(
    mixer: GatedDeltaNet, proj: torch.Tensor, state: LayerState, slot: int
) -> torch.Tensor:
    """torch's mixer over one sequence's rows proj [n, width] (the input projection's), its states at
    `slot` updated in place -> [n, value_dim] fp32. The C kernel's steps token by token, its sums in torch's
    order (within rounding of the C kernel's, not its bits: one backend serves an engine)."""
    lin, n = mixer.shape, proj.shape[0]
    hk, hv, dk, dv = lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim
    proj = proj.float()
    mixed, z, b, a = proj.split([lin.conv_dim, mixer.value_dim, hv, hv], dim=-1)
    conv = F.silu(causal_conv(state.conv[slot], mixed, mixer.conv1d.weight.float().squeeze(1)))
    q, k, v = conv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = _l2norm(q.reshape(n, hk, dk)) / dk**0.5
    k = _l2norm(k.reshape(n, hk, dk))
    q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    v = v.reshape(n, hv, dv)
    decay = torch.exp(-mixer.A_log.float().exp() * F.softplus(a + mixer.dt_bias.float()))  # [n, hv]
    beta = torch.sigmoid(b)
    s = state.recurrent[slot]  # [hv, dk, dv]
    out = torch.empty(n, hv, dv, device=proj.device)
    for t in range(n):
        s.mul_(decay[t, :, None, None])
        kv_mem = (s * k[t, :, :, None]).sum(dim=1)
        delta = (v[t] - kv_mem) * beta[t, :, None]
        s.add_(k[t, :, :, None] * delta[:, None, :])
        out[t] = (s * q[t, :, :, None]).sum(dim=1)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + mixer.eps)
    gated = mixer.norm.weight.float() * normed * F.silu(z.reshape(n, hv, dv))
    return gated.reshape(n, mixer.value_dim)


def causal_conv(state_row: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, channels] after a sequence's conv state [kernel - 1, channels] (its last inputs, oldest first)
    through a depthwise causal conv of weight [channels, kernel]: each output a sum of products, oldest tap
    first, element by element (the same bits in any batch); the state advanced in place -> [n, channels]."""
    n, kernel = x.shape[0], weight.shape[1]
    window = torch.cat((state_row, x), dim=0)  # [kernel - 1 + n, channels]
    acc = window[0:n] * weight[:, 0]
    for j in range(1, kernel):
        acc = acc + window[j : j + n] * weight[:, j]
    state_row.copy_(window[n:])
    return acc


def each_sequence(span, mixer: nn.Module, proj: torch.Tensor, state: LayerState, spans, width: int) -> torch.Tensor:
    """A step's rows [T, in] -> [T, width] fp32, `span(mixer, rows, state, slot)` a sequence (StateSpan)."""
    out = torch.empty(proj.shape[0], width, dtype=torch.float32, device=proj.device)
    for first, num, slot in spans:
        out[first : first + num] = span(mixer, proj[first : first + num], state, slot)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
