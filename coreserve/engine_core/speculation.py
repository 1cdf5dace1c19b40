"""Speculative decoding, the scheduler's side (engine-core process): how many tokens each decoding
request may have proposed and verified this step, and what a round's outcome changes (docs/speculative.md).

The worker proposes (coreserve/worker/speculative/) and verifies; the scheduler only holds the budget and the KV
blocks for the proposals and adapts each request's proposal length to what its rounds keep:
- a round that keeps every proposed token lengthens the next proposal by one (up to the configured
  number), one that keeps fewer proposes one more than it kept;
- a request whose rounds keep nothing twice in a row stops proposing for 2, 4, 8 ... 64 steps (a
  proposal that keeps nothing costs the verification of its positions and gains no token), so a workload
  that proposals do not fit runs at its speed without them;
- a step verifies at most STEP_ROWS rows: a full batch proposes nothing (its step already reads the
  weights for many rows), a small one shares the room.
"""

from __future__ import annotations

from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.request import Request
from coreserve.protocol.config import SpeculativeConfig
from coreserve.protocol.prompt_lookup import lookup
from coreserve.protocol.step import SchedulerOutput

MAX_PAUSE = 64  # steps without proposals after a run of rounds that kept nothing, at most
# Rows a step may verify in all (its decode rows and the proposals): a few rows cost little more than one
# (the step streams the weights once), many cost in proportion. On this CPU a Q4_1 SmolLM2 step of 1, 5
# and 9 rows took 7.5, 19.5 and 23.6 ms (fp32: 20.7, 27.8, 32.6), and at concurrency 16 proposals made the
# steps slower than the tokens they saved (0.88x): past this many rows no request proposes.
STEP_ROWS = 10


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_rounds = 0  # rounds with at least one proposed token, since start
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens  # kept at proposal position i
        self.room = 0  # proposals this step may still hold (begin_step)

    def begin_step(self, num_running: int) -> None:
        """A new step with `num_running` requests in the batch: its room for proposals (none at
        disable_by_batch_size or more)."""
        limit = self.config.disable_by_batch_size
        self.room = 0 if limit is not None and num_running >= limit else max(0, STEP_ROWS - num_running)

    def allocate(
        self, req: Request, num_new: int, budget: int, kv_cache: KVCacheManager, max_len: int
    ) -> tuple[int, list[int] | None]:
        """(proposals, new blocks) for a running request scheduled `num_new` tokens, its blocks grown for
        them; (0, None) where it does not speculate this step (not decoding, no room, or too few free
        blocks: no request is preempted for proposals). `max_len`: the most tokens `req` may hold after
        the step (max_model_len, or LongRoPE's switch + 1 on the short factors)."""
        if num_new != 1 or req.num_output_tokens == 0:
            return 0, None
        num_spec = self.num_tokens(req, budget, max_len)
        if not num_spec:
            return 0, None
        new_blocks = kv_cache.allocate(req.req_id, req.num_computed_tokens + 1 + num_spec)
        if new_blocks is None:
            self.room += num_spec
            return 0, None
        return num_spec, new_blocks

    def num_tokens(self, req: Request, budget: int, max_len: int) -> int:
        """Proposals `req` may have after its one scheduled decode token this step (0: none)."""
        config = self.config
        if req.params.disable_spec_decode or req.params.hidden_indices is not None:
            return 0  # hidden states: a position's row comes from the plain step (docs/logprobs.md)
        if req.grammar is not None and config.method != "ngram":  # a draft cannot see the grammar
            return 0
        if req.spec_pause > 0:
            req.spec_pause -= 1
            return 0
        k = min(req.spec_k or config.num_speculative_tokens, self.room)
        if req.max_tokens is not None:
            k = min(k, req.max_tokens - req.num_output_tokens - 1)  # the last token is the model's own
        k = max(0, min(k, budget - 1, max_len - req.num_tokens - 1))
        self.room -= k
        return k

    def propose_for_grammars(self, reqs: list[Request], output: SchedulerOutput) -> None:
        """Prompt lookup for the step's grammar requests that may speculate, here in the core: their
        matchers must walk the proposals to give each verified position its bitmask (Grammars.add_bitmask
        cuts a proposal at the first token its grammar refuses)."""
        low, high = self.config.lookup_range()
        for req in reqs:
            k = output.spec_tokens.get(req.req_id, 0)
            if req.grammar is not None and k:
                drafts = lookup(req.all_token_ids, low, high, k)
                if drafts:
                    output.spec_drafts[req.req_id] = drafts
                else:
                    del output.spec_tokens[req.req_id]

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """One verified round of `req`: `num_accepted` of its `num_drafts` proposed tokens kept (their KV
        is the model's own: computed)."""
        req.num_computed_tokens += num_accepted
        self.num_rounds += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        most = self.config.num_speculative_tokens
        req.spec_k = min(most, num_drafts + 1) if num_accepted == num_drafts else min(most, num_accepted + 1)
        if num_accepted:
            req.spec_misses = 0
            return
        req.spec_misses += 1
        if req.spec_misses >= 2:
            req.spec_pause = min(MAX_PAUSE, 2 ** (req.spec_misses - 1))
