"""Stop conditions the core applies token by token (stop strings are the frontend's)."""

from __future__ import annotations

from engine_core.request import Request
from protocol.messages import FinishReason


def check_stop(req: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Checks the request's last token, in vLLM's order: length caps first, then EOS and stop ids,
    which only count once min_tokens tokens were generated."""
    if req.num_tokens >= max_model_len or (
        req.max_tokens is not None and req.num_output_tokens >= req.max_tokens
    ):
        return FinishReason.LENGTH, None
    if req.num_output_tokens < req.params.min_tokens:
        return None
    last = req.output_token_ids[-1]
    if last in req.eos_token_ids:
        return FinishReason.STOP, None
    if req.params.stop_token_ids and last in req.params.stop_token_ids:
        return FinishReason.STOP, last
    return None
