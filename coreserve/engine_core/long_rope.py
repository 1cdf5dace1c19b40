"""LongRoPE's rule on the scheduler's side (engine-core process): a request holding more tokens than the
switch (`original_max_position_embeddings`) runs every position on the long factors, one at or below it
on the short ones, chosen per request, never by the batch (docs/models.md). A request on the short
factors that outgrows the switch starts again from its first token on the long ones, as HF's Phi-3
`generate` drops its cache there; its steps stop at the crossing."""

from __future__ import annotations

from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.request import Request
from coreserve.protocol.step import SchedulerOutput


class LongRopeRule:
    def __init__(self, switch: int | None, max_model_len: int) -> None:
        self.switch, self.max_model_len = switch, max_model_len  # switch None: no LongRoPE

    def is_past_switch(self, req: Request) -> bool:
        """Whether `req` holds more tokens than the switch (its forwards take the long factors)."""
        return self.switch is not None and req.num_tokens > self.switch

    def max_len(self, req: Request) -> int:
        """The most tokens `req` may hold after a step: max_model_len, or on the short factors one past
        the switch (a token sampled there is the short factors' last; then it is computed again)."""
        if req.is_long_rope or self.switch is None:
            return self.max_model_len
        return min(self.max_model_len, self.switch + 1)

    def restart(self, req: Request, kv_cache: KVCacheManager, output: SchedulerOutput) -> bool:
        """A running request on the short factors that outgrew the switch starts again on the long ones,
        from its first token: its blocks freed (the runner drops its state). Returns whether it did."""
        if req.is_long_rope or not self.is_past_switch(req):
            return False
        kv_cache.free(req.req_id)
        req.num_computed_tokens, req.is_long_rope = 0, True
        output.finished_req_ids.add(req.req_id)
        return True
