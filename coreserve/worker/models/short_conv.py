"""The short convolution mixer of LFM2's conv layers (engine-core process): a conv state a sequence, the
last kernel - 1 inputs, in place of a KV cache (coreserve/worker/kv_memory.py's state slots).

in_proj gives B, C and x; y = C * conv(B * x), the conv depthwise and causal over the hidden size, from the
sequence's conv state; then out_proj. Every step is a product or a sum of two floats, element by element,
in one order (the kernel's taps oldest first), so torch's ops give the same bits for a token whatever the
rest of the batch, the chunk or the backend: CPU and torch share `short_conv_span`.
"""

from __future__ import annotations

import torch
from torch import nn

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.gated_deltanet import LayerState, causal_conv, each_sequence


class ShortConv(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        assert args.short_conv is not None
        hidden, kernel, has_bias = args.hidden_size, args.short_conv.kernel, args.short_conv.has_bias
        self.hidden_size, self.kernel = hidden, kernel
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=has_bias)  # [B | C | x]
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=has_bias)  # weight [hidden, 1, kernel]
        self.out_proj = nn.Linear(hidden, hidden, bias=has_bias)


def short_conv_span(mixer: ShortConv, proj: torch.Tensor, state: LayerState, slot: int) -> torch.Tensor:
    """One sequence's rows proj [n, 3 hidden] (in_proj's) -> C * conv(B * x) [n, hidden] fp32, its conv
    state at `slot` ([kernel - 1, hidden], oldest first) advanced in place."""
    b, c, x = proj.float().split(mixer.hidden_size, dim=-1)
    acc = causal_conv(state.conv[slot], b * x, mixer.conv.weight.float().squeeze(1))
    if mixer.conv.bias is not None:
        acc = acc + mixer.conv.bias.float()
    return c * acc


def short_conv(mixer: ShortConv, proj: torch.Tensor, state: LayerState, spans) -> torch.Tensor:
    """Every sequence of the step (`spans`: StateSpan), each from and to its slot -> [T, hidden] fp32."""
    return each_sequence(short_conv_span, mixer, proj, state, spans, mixer.hidden_size)
