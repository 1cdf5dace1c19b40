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
    rows_of: dict[str, list[int]] = {}  # a verified request samples several rows: its bitmask rows follow them
    for row, req_id in enumerate(sampled_req_ids):
        rows_of.setdefault(req_id, []).append(row)
    taken: dict[str, int] = {}
    row_of = []
    for req_id in grammar_req_ids:
        row_of.append(rows_of[req_id][taken.get(req_id, 0)])
        taken[req_id] = taken.get(req_id, 0) + 1
    words = -(-vocab_size // _BITS)
    # Bit j of little-endian int32 word w is token 32 w + j, so in byte order bit k of byte i is token
    # 8 i + k: numpy's little-endian unpack in one C pass (7x the shift-and-mask of [G, W, 32] ints).
    packed = np.frombuffer(bitmask, dtype=np.uint8).reshape(len(grammar_req_ids), words * 4)
    bits = np.unpackbits(packed, axis=-1, bitorder="little")[:, :vocab_size]
    is_allowed = torch.from_numpy(bits).to(device=device, dtype=torch.bool)
    rows = torch.tensor(row_of, dtype=torch.int64, device=device)
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
