"""Stop conditions the core applies token by token (stop strings are the frontend's)."""

from __future__ import annotations

from coreserve.engine_core.request import Request
from coreserve.protocol.messages import FinishReason


def check_stop(req: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Checks the request's last token in vLLM's order: nothing stops it before min_tokens (but the
    model's length), then EOS and stop token ids, then the length caps; so a last token that is EOS
    is "stop", not "length". The first EOS id is the model's own (stop_reason None); any other EOS id
    (generation_config lists several) stops as a stop token id does, with itself as stop_reason, as
    vLLM does when it adds generation_config's extra EOS ids to stop_token_ids."""
    if req.num_output_tokens >= req.params.min_tokens:
        last = req.output_token_ids[-1]
        if last in req.eos_token_ids:
            return FinishReason.STOP, None if last == req.eos_token_ids[0] else last
        if req.params.stop_token_ids and last in req.params.stop_token_ids:
            return FinishReason.STOP, last
    if req.num_tokens >= max_model_len or (
        req.max_tokens is not None and req.num_output_tokens >= req.max_tokens
    ):
        return FinishReason.LENGTH, None
    return None


def append_until_stop(req: Request, token_ids: list[int], max_model_len: int) -> int:
    """Appends a step's (or a window's) tokens one by one; those after a stop, or after the grammar's
    output is complete, are discarded. Returns how many stayed."""
    for num, token_id in enumerate(token_ids, start=1):
        req.append_token(token_id)
        stop = check_stop(req, max_model_len)
        if stop is None and req.grammar is not None and req.grammar.has_ended_after(token_id):
            stop = FinishReason.STOP, None
        if stop is not None:
            req.finish(*stop)
            return num
    return len(token_ids)
