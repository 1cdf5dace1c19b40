"""The Mamba2 mixer of Granite 4.0-H's mamba layers (engine-core process): a conv state and an SSM state a
sequence in place of a KV cache (coreserve/worker/kv_memory.py's state slots).

in_proj gives [z | x B C | dt]; then, sequence by sequence, `ops.mamba2` (the CPU's: csrc/recurrent_mixers.c;
torch's: `mamba2_span` below): the causal depthwise conv over x, B and C from the sequence's conv state (its
bias added after the taps) and silu; dt = softplus(dt + dt_bias), A = -exp(A_log); each head's state
[head_dim, d_state] decays by exp(dt A) and takes (dt B) x^T, B and C those of the head's group; y = S C +
D x; then HF's gated RMSNorm: y times silu(z), normed over each group's slice of the inner width, times
its weight; then out_proj. Token by token for a prompt as for decoding, as HF's `generate` steps: the one
order, so that scoring a sequence gives the bits of generating it (HF computes a prompt in chunks of
`mamba_chunk_size`: the same numbers within rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.gated_deltanet import LayerState, causal_conv, each_sequence
from coreserve.worker.models.recurrent_args import Mamba2Args


class Mamba2(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        assert args.mamba is not None
        self.shape: Mamba2Args = args.mamba
        m = self.shape
        self.inner = m.inner
        # [z | x B C | dt]: the gate, the conv's channels, a time step a head
        self.in_proj = nn.Linear(args.hidden_size, m.inner + m.conv_dim + m.num_heads, bias=m.has_proj_bias)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, m.conv_kernel, groups=m.conv_dim, bias=m.has_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = nn.Module()  # HF's gated RMSNorm by group: weight [inner], no offset
        self.norm.weight = nn.Parameter(torch.empty(m.inner))
        self.eps = args.rms_norm_eps
        self.out_proj = nn.Linear(m.inner, args.hidden_size, bias=m.has_proj_bias)


def mamba2_span(mixer: Mamba2, proj: torch.Tensor, state: LayerState, slot: int) -> torch.Tensor:
    """torch's mixer over one sequence's rows proj [n, width] (in_proj's), its states at `slot` updated in
    place -> [n, inner] fp32: HF's decoding step's arithmetic token by token (within rounding of the C
    kernel's, not its bits: one backend serves an engine)."""
    m, n = mixer.shape, proj.shape[0]
    heads, groups, size = m.num_heads, m.num_groups, m.state_size
    z, xbc, dt = proj.float().split([m.inner, m.conv_dim, heads], dim=-1)
    conv = causal_conv(state.conv[slot], xbc, mixer.conv1d.weight.float().squeeze(1))
    if mixer.conv1d.bias is not None:
        conv = conv + mixer.conv1d.bias.float()
    x, b, c = F.silu(conv).split([m.inner, groups * size, groups * size], dim=-1)
    x = x.reshape(n, heads, m.head_dim)
    b = b.reshape(n, groups, size).repeat_interleave(heads // groups, dim=1)  # [n, heads, size]: a group's
    c = c.reshape(n, groups, size).repeat_interleave(heads // groups, dim=1)
    dt = F.softplus(dt + mixer.dt_bias.float())  # [n, heads]
    decay = torch.exp(dt * -torch.exp(mixer.A_log.float()))
    s = state.recurrent[slot]  # [heads, head_dim, size]
    y = torch.empty(n, heads, m.head_dim, device=proj.device)
    for t in range(n):
        s.mul_(decay[t, :, None, None]).add_((dt[t, :, None] * b[t])[:, None, :] * x[t, :, :, None])
        y[t] = (s * c[t, :, None, :]).sum(dim=-1)
    y = y + x * mixer.D.float()[:, None]
    gated = (y.reshape(n, m.inner) * F.silu(z)).reshape(n, groups, m.inner // groups)
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + mixer.eps)
    return mixer.norm.weight.float() * normed.reshape(n, m.inner)


def mamba2(mixer: Mamba2, proj: torch.Tensor, state: LayerState, spans) -> torch.Tensor:
    """Every sequence of the step (`spans`: StateSpan), each from and to its slot -> [T, inner] fp32."""
    return each_sequence(mamba2_span, mixer, proj, state, spans, mixer.inner)
