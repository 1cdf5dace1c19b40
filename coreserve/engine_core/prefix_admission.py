"""What admission reads from the prefix cache (engine-core process): a request's cached prefix, with the
prompt-logprob rows its blocks keep, and whether a running request is computing the prefix it could read
after this step. Called by the scheduler (coreserve/engine_core/scheduler.py) for the head of its queue.
"""

from __future__ import annotations

from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.long_rope import LongRopeRule
from coreserve.engine_core.prompt_rows import flavour_of
from coreserve.engine_core.request import Request


def read_cached_prefix(kv: KVCacheManager, req: Request) -> None:
    """Takes the request's cached prefix (never its last token: its logits are needed). One that still
    owes prompt logprobs reads only blocks that keep its rows (coreserve/engine_core/prompt_rows.py), and
    takes those rows."""
    flavour = None if req.has_sent_prompt_logprobs else flavour_of(req.params)
    tokens = req.all_token_ids
    req.num_computed_tokens = kv.take_cached_prefix(
        req.req_id, tokens, req.num_tokens - 1, flavour, req.cache_salt, req.is_long_rope
    )
    if req.num_output_tokens == 0:
        req.num_cached_tokens = req.num_computed_tokens
    if flavour is not None and req.num_computed_tokens:
        req.prompt_logprob_parts = [kv.prompt_rows.take(kv.blocks_of(req.req_id), tokens, flavour)]


def is_prefix_being_computed(kv: KVCacheManager, long_rope: LongRopeRule, running: list[Request],
                             req: Request) -> bool:
    """`req`'s first block is not cached yet, but a running request with the same first block is
    computing it (n > 1, one system prompt): waiting for it lets `req` read the prefix the two share
    instead of computing it again (a hybrid's: where its prompt passes a snapshot boundary)."""
    size = kv.block_size
    if req.num_prompt_tokens <= size:
        return False
    if kv.snapshots is not None and req.num_prompt_tokens <= kv.snapshots.every_tokens:
        return False  # a hybrid's hit lands on a snapshot boundary: none within this prompt, nothing to wait for
    first, salt, is_long = req.prompt_token_ids[:size], req.cache_salt, long_rope.is_past_switch(req)
    # its first block cached: it reads what is there (a hybrid's hit needs a snapshot at a boundary, which
    # a running request may still be computing: it waits for that request as below)
    if kv.snapshots is None and kv.index.lookup(kv.index.root_of(salt, is_long), tuple(first)) is not None:
        return False
    return any(
        r.prompt_token_ids[:size] == first
        and r.cache_salt == salt
        and r.is_long_rope == is_long
        and kv.num_indexed_tokens(r.req_id) < (min(r.num_prompt_tokens, req.num_prompt_tokens) - 1) // size * size
        for r in running
    )
