"""A request's own logit rules, vLLM's `allowed_token_ids` and `logit_bias`, applied to the logits before
penalties, temperature and filtering (engine-core process).

Built only for steps where some sampling row has them: a batch without any pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coreserve.protocol.sampling_params import SamplingParams


@dataclass
class LogitRules:
    allowed_rows: torch.Tensor | None  # [A] int64 rows that may sample only some tokens
    is_disallowed: torch.Tensor | None  # [A, V] bool, True: the token's logit becomes -inf
    bias_rows: torch.Tensor | None  # [B] int64 row of each (row, token) bias
    bias_token_ids: torch.Tensor | None  # [B] int64
    bias_values: torch.Tensor | None  # [B] float32, added to the logit


def build_logit_rules(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> LogitRules | None:
    """None when no row has a rule. Token ids are below `vocab_size` (checked by the frontend and the
    core before the request was queued)."""
    if not any(p.has_logit_rules for p in params):
        return None
    allowed = [(row, p.allowed_token_ids) for row, p in enumerate(params) if p.allowed_token_ids is not None]
    bias = [(row, t, v) for row, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
    rules = LogitRules(None, None, None, None, None)
    if allowed:
        rules.allowed_rows = torch.tensor([row for row, _ in allowed], dtype=torch.int64, device=device)
        rules.is_disallowed = torch.ones((len(allowed), vocab_size), dtype=torch.bool, device=device)
        index_rows = [i for i, (_, ids) in enumerate(allowed) for _ in ids]
        index_ids = [t for _, ids in allowed for t in ids]
        rules.is_disallowed[index_rows, index_ids] = False
    if bias:
        rows, token_ids, values = zip(*bias)
        rules.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        rules.bias_token_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        rules.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
    return rules


def apply_logit_rules(logits: torch.Tensor, rules: LogitRules) -> torch.Tensor:
    """logits: [R, V] float32, changed in place (the sampler's own copy) and returned. The allowed set
    first, then the bias, as vLLM orders them: a biased token outside the allowed set stays -inf."""
    if rules.allowed_rows is not None:
        restricted = logits.index_select(0, rules.allowed_rows).masked_fill_(
            rules.is_disallowed, float("-inf")
        )
        logits.index_copy_(0, rules.allowed_rows, restricted)
    if rules.bias_rows is not None:
        index = (rules.bias_rows, rules.bias_token_ids)
        logits.index_put_(index, rules.bias_values.to(logits.dtype), accumulate=True)
    return logits
