"""Multi-step windows (engine-core process): a decode-only batch runs up to num_scheduler_steps model
steps before the scheduler looks again, its blocks for the whole window reserved up front."""

from __future__ import annotations

from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.request import Request
from coreserve.protocol.step import SchedulerOutput


def extend_to_window(
    output: SchedulerOutput,
    reqs: list[Request],
    kv_cache: KVCacheManager,
    num_scheduler_steps: int,
    max_lens: list[int],
) -> None:
    """Turns a one-step decode batch (`reqs`, in `output.cached_reqs`' order) into a window where it
    can. `max_lens`: per request, the most tokens it may hold after the window (max_model_len, or
    LongRoPE's switch + 1 on the short factors). Tokens past a stop are dropped later."""
    if not reqs or any(n != 1 for n in output.num_scheduled_tokens.values()):
        return
    if any(r.grammar is not None for r in reqs):
        return  # the matchers advance on the host, token by token: one step
    if any(r.num_output_tokens == 0 or r.num_computed_tokens != r.num_tokens for r in reqs):
        return  # a prefill (a first one, or a recompute after preemption) is in the batch: run single
    num_steps = min(
        num_scheduler_steps,
        max(_tokens_left(r, num_scheduler_steps) for r in reqs),  # no longer than the batch needs
        min(max_len - r.num_tokens for r, max_len in zip(reqs, max_lens)),  # tokens the lengths allow
    )
    # Every request's blocks or none: a window that does not fit is halved, down to a single step,
    # so that it never holds blocks for later steps while another request goes short.
    while num_steps >= 2 and _window_blocks(kv_cache, reqs, num_steps) > kv_cache.num_free_blocks:
        num_steps //= 2
    if num_steps < 2:
        return
    for req, data in zip(reqs, output.cached_reqs):
        new_blocks = kv_cache.allocate(req.req_id, req.num_computed_tokens + num_steps - 1)
        assert new_blocks is not None  # counted above
        data.new_block_ids.extend(new_blocks)
    for req in reqs:
        req.num_computed_tokens += num_steps - 1
    output.num_steps = num_steps


def _tokens_left(req: Request, num_scheduler_steps: int) -> int:
    """Tokens `req` may still generate before max_tokens (the model's length is capped apart)."""
    return num_scheduler_steps if req.max_tokens is None else req.max_tokens - req.num_output_tokens


def _window_blocks(kv: KVCacheManager, reqs: list[Request], num_steps: int) -> int:
    """New blocks a window of `num_steps` needs. Every row of a window writes its KV each step, even
    past its own stop, so each request holds blocks for all of the window's positions."""
    return sum(
        max(0, kv.num_blocks_needed(r.num_computed_tokens + num_steps - 1) - len(kv.blocks_of(r.req_id)))
        for r in reqs
    )
