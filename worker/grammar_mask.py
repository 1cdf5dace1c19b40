"""The scheduler's grammar bitmask as the sampler's mask, and the probability mass it allows (engine-core
process).

Built only for steps where some sampling row has a grammar: a batch without one builds nothing.
docs/structured_outputs.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_BITS = 32


@dataclass
class GrammarMask:
    rows: torch.Tensor  # [G] int64 sampling rows under a grammar
    is_allowed: torch.Tensor  # [G, V] bool, False: the token's logit becomes -inf before sampling


def build_grammar_mask(
    grammar_req_ids: list[str],
    bitmask: bytes,
    sampled_req_ids: list[str],
    vocab_size: int,
    device: torch.device,
) -> GrammarMask | None:
    """None when no row of this step has a grammar. `bitmask` rows follow `grammar_req_ids`
    (SchedulerOutput's); the rows of the mask follow the sampling rows (`sampled_req_ids`)."""
    if not grammar_req_ids:
        return None
    row_of = {req_id: row for row, req_id in enumerate(sampled_req_ids)}
    words = -(-vocab_size // _BITS)
    packed = np.frombuffer(bitmask, dtype="<i4").reshape(len(grammar_req_ids), words)
    packed = torch.from_numpy(packed.astype(np.int32)).to(device)  # [G, W]
    shifts = torch.arange(_BITS, dtype=torch.int32, device=device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]: bit j of word w is token 32 w + j
    is_allowed = bits.reshape(len(grammar_req_ids), words * _BITS)[:, :vocab_size].bool()
    rows = torch.tensor([row_of[r] for r in grammar_req_ids], dtype=torch.int64, device=device)
    return GrammarMask(rows, is_allowed)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """logits: [R, V] float32, the sampler's own copy, changed in place and returned."""
    masked = logits.index_select(0, mask.rows).masked_fill_(~mask.is_allowed, float("-inf"))
    return logits.index_copy_(0, mask.rows, masked)


def allowed_mass(raw_logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """[G] float32: per grammar row, the probability the model's own distribution (softmax of the raw
    logits, before any rule or temperature) gives the tokens the grammar allows."""
    rows = raw_logits.index_select(0, mask.rows).float()
    allowed = rows.masked_fill(~mask.is_allowed, float("-inf"))
    return torch.exp(torch.logsumexp(allowed, dim=-1) - torch.logsumexp(rows, dim=-1))
