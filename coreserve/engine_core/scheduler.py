"""The scheduler: continuous batching under a token budget, chunked prefill, preemption by recompute
(engine-core process). No prefill or decode phase: each request's computed-token count catches up with
its token count, a budget's worth at a time.

LongRoPE (Phi-3): the factors are chosen per request, at admission (coreserve/engine_core/long_rope.py).
"""

from __future__ import annotations

from collections import defaultdict

from coreserve.engine_core.grammars import Grammars, wait_for_any
from coreserve.engine_core.kv_cache_manager import KVCacheManager
from coreserve.engine_core.long_rope import LongRopeRule
from coreserve.engine_core.lora_table import LoraTable
from coreserve.engine_core.multi_step import extend_to_window
from coreserve.engine_core.outputs import add_hidden_states, add_token_extras, make_output, pooled_output
from coreserve.engine_core.prefix_admission import is_prefix_being_computed, read_cached_prefix
from coreserve.engine_core.prompt_rows import flavour_of
from coreserve.engine_core.request import Request, RequestStatus
from coreserve.engine_core.speculation import SpeculationPolicy
from coreserve.engine_core.stop import append_until_stop
from coreserve.engine_core.waiting_queue import WaitingQueue
from coreserve.protocol.config import SpeculativeConfig
from coreserve.protocol.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from coreserve.protocol.step import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_scheduler_steps: int = 1,
        grammars: Grammars | None = None,
        speculative: SpeculativeConfig | None = None,
        long_rope_switch: int | None = None,
        loras: LoraTable | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.long_rope = LongRopeRule(long_rope_switch, max_model_len)  # switch None: no LongRoPE
        self.grammars = grammars  # structured outputs; None: every request is unconstrained
        self.compiling: list[Request] = []  # waiting for their grammar; the others are scheduled meanwhile
        self.failed: list[tuple[Request, str]] = []  # grammars that did not compile, with why: reported next
        self.num_with_grammar = 0  # requests in flight with a grammar: 0 skips every grammar step
        self.num_scheduler_steps = num_scheduler_steps
        self.speculation = None if speculative is None else SpeculationPolicy(speculative)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()  # round-robin across clients, FCFS within one
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule(): the worker drops them
        self.num_preemptions = 0  # since start, for stats and tests
        self.num_prefill_tokens = 0  # prompt positions computed since start (cache hits are not)
        # RL control (coreserve/engine_core/rl_control.py): waiting requests stay waiting while admissions are
        # held; a frozen scheduler schedules nothing (running requests keep their blocks).
        self.can_admit = True
        self.is_frozen = False
        self.loras = loras  # LoRA (coreserve/engine_core/lora_table.py): slots taken at admission, released at the end

    def add_request(self, req: Request) -> None:
        self.requests[req.req_id] = req
        if self.loras is not None and req.params.lora is not None:
            self.loras.add_waiter(req.params.lora)  # a load read for it is kept until it is admitted
        if req.params.structured_outputs is None:
            self.waiting.append(req)
            return
        assert self.grammars is not None, "a scheduler without grammars got a structured request"
        req.grammar = self.grammars.for_request(req.params)
        self.num_with_grammar += 1
        self.compiling.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.compiling)

    def has_schedulable_requests(self) -> bool:
        """Whether a step now would schedule anything (held admissions and a freeze say no)."""
        is_queued = bool(self.waiting or self.compiling or self.failed)
        return not self.is_frozen and bool(self.running or (self.can_admit and is_queued))

    def preempt_running(self) -> None:
        """Every running request back to the head of the waiting queue, its blocks freed: it is
        computed again later (sleep frees the KV cache under frozen requests)."""
        for req in reversed(self.running):
            self.kv_cache.free(req.req_id)
            req.reset_for_recompute()
            self.waiting.appendleft(req)
            self.finished_req_ids.add(req.req_id)
        self.running = []

    def abort_requests(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req in self.compiling:
                self.compiling.remove(req)
            elif req.status == RequestStatus.WAITING:
                self.waiting.remove(req)
            elif req in self.running:
                self.running.remove(req)
            req.finish(FinishReason.ABORT)
            self._free(req)

    def schedule(self) -> SchedulerOutput:
        budget = 0 if self.is_frozen else self.max_num_batched_tokens
        if self.compiling and not self.is_frozen:
            self._take_compiled()
        output = SchedulerOutput([], [], {}, self.finished_req_ids)
        self.finished_req_ids = set()
        num_preemptions_before = self.num_preemptions
        if self.speculation is not None:
            self.speculation.begin_step(len(self.running))
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            is_restarted = self.long_rope.restart(req, self.kv_cache, output)
            if is_restarted and self.kv_cache.index is not None and req.can_read_prefix_cache:
                read_cached_prefix(self.kv_cache, req)  # its long prefix, where another request computed it
            num_new = self._chunk(req, budget)
            num_spec, new_blocks = 0, None
            if self.speculation is not None:
                max_len = self.long_rope.max_len(req)
                num_spec, new_blocks = self.speculation.allocate(req, num_new, budget, self.kv_cache, max_len)
            if not num_spec:
                new_blocks = self._allocate_or_preempt(req, num_new, output)
            if new_blocks is None:
                break
            if is_restarted:  # the worker takes it anew (its old state dropped first)
                output.new_reqs.append(self._new_request_data(req))
            else:
                output.cached_reqs.append(CachedRequestData(req.req_id, new_blocks, req.num_computed_tokens))
            self._commit(req, num_new, output)
            if num_spec:
                output.spec_tokens[req.req_id] = num_spec
            budget -= num_new + num_spec
            index += 1
        is_preempted = self.num_preemptions > num_preemptions_before
        can_admit = self.can_admit and not is_preempted  # no admissions while memory is short, or held
        # waiting for room for their adapter (max_loras) or for its read (between steps): they keep their turn
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and can_admit:
            if self.loras is not None and not self._is_adapter_ready(self.waiting[0]):
                if len(skipped) == self.max_num_seqs:
                    break
                skipped.append(self.waiting.popleft())
                continue
            num_new = self._admit(self.waiting[0], budget, output)
            if num_new is None:
                break
            budget -= num_new
        for req in reversed(skipped):
            self.waiting.appendleft(req)
        is_plain = not output.new_reqs and not output.spec_tokens and not output.state_snapshots
        if self.num_scheduler_steps > 1 and not is_preempted and is_plain:
            reqs = [self.requests[data.req_id] for data in output.cached_reqs]
            max_lens = [self.long_rope.max_len(req) for req in reqs]
            extend_to_window(output, reqs, self.kv_cache, self.num_scheduler_steps, max_lens)
        if self.num_with_grammar:
            reqs = [self.requests[r] for r in output.num_scheduled_tokens]
            if output.spec_tokens:  # a grammar request's proposals are made here, to be walked by its matcher
                self.speculation.propose_for_grammars(reqs, output)
            self.grammars.add_bitmask(output, reqs)
        return output

    def _take_compiled(self) -> None:
        """Requests whose grammar compiled join the waiting queue; one that failed is reported with its
        error. With nothing else to run, the step waits a moment for a compile rather than spin."""
        if not self.running and not self.waiting:
            wait_for_any([req.grammar for req in self.compiling])
        pending = []
        for req in self.compiling:
            if not req.grammar.is_compiled:
                pending.append(req)
            elif (error := req.grammar.error()) is not None:
                self._fail(req, error)
            else:
                self.grammars.start(req.grammar)
                self.waiting.append(req)
        self.compiling = pending

    def _is_adapter_ready(self, req: Request) -> bool:
        """Whether `req`'s adapter may run now: room among the step's (max_loras) and resident (else its
        read is asked for, done by the core before the next step; nothing is read here)."""
        return self.loras.has_room(req, self.running) and self.loras.is_ready(req, self.running)

    def fail_adapter_waiters(self, int_id: int, error: str) -> None:
        """The requests waiting for adapter `int_id`, whose read failed, fail with `error` (reported with
        the next outputs); the others go on."""
        for req in list(self.requests.values()):
            lora = req.params.lora
            if lora is None or lora.int_id != int_id or req.lora_slot >= 0 or req.status != RequestStatus.WAITING:
                continue
            if req in self.compiling:
                self.compiling.remove(req)
            else:
                self.waiting.remove(req)
            self._fail(req, error)

    def _admit(self, req: Request, budget: int, output: SchedulerOutput) -> int | None:
        """Schedules the head of the waiting queue, after its cached prefix when it may read the cache;
        returns its scheduled tokens, or None when it must wait (no blocks, or its prefix is being
        computed by a running request and will be in the cache after this step)."""
        error = self.loras.admit(req) if self.loras is not None else None  # its resident adapter's slot held
        if error is not None:  # this request alone fails, reported with the step's outputs
            self._fail(self.waiting.popleft(), error)
            return 0
        can_read_cache = self.kv_cache.index is not None and req.can_read_prefix_cache
        if can_read_cache and is_prefix_being_computed(self.kv_cache, self.long_rope, self.running, req):
            return None
        req.is_long_rope = self.long_rope.is_past_switch(req)
        if can_read_cache:
            read_cached_prefix(self.kv_cache, req)
        num_new = self._chunk(req, budget)
        if not num_new:  # a pooling prompt waits for a step with room for all of it
            return None
        if self.kv_cache.allocate(req.req_id, req.num_computed_tokens + num_new) is None:
            self.kv_cache.free(req.req_id)
            req.reset_for_recompute()
            return None
        self.waiting.popleft()
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        output.new_reqs.append(self._new_request_data(req))
        self._commit(req, num_new, output)
        return num_new

    def _new_request_data(self, req: Request) -> NewRequestData:
        """What the worker takes a request (anew) with: its blocks, and a hybrid's snapshot to start from."""
        return req.new_request_data(self.kv_cache.blocks_of(req.req_id), self.kv_cache.restore_slot(req.req_id))

    def _chunk(self, req: Request, budget: int) -> int:
        """The request's tokens this step within `budget` (a hybrid's cut at its next snapshot boundary); a
        pooling request's whole prompt or none (bidirectional attention and its pooled rows need them all in
        one step: its engine's budget is at least max_model_len, coreserve/engine_core/core.py)."""
        num_left = req.num_tokens - req.num_computed_tokens
        if req.params.pooling is not None:
            return num_left if num_left <= budget else 0
        return self.kv_cache.cut_chunk(req.num_computed_tokens, min(num_left, budget))

    def _commit(self, req: Request, num_new: int, output: SchedulerOutput) -> None:
        output.num_scheduled_tokens[req.req_id] = num_new
        self.num_prefill_tokens += max(
            0, min(req.num_computed_tokens + num_new, req.num_prompt_tokens) - req.num_computed_tokens
        )
        req.num_computed_tokens += num_new
        slot = self.kv_cache.plan_snapshot(req.req_id, req.num_computed_tokens)  # a hybrid's, at a boundary
        if slot is not None:
            output.state_snapshots[req.req_id] = slot

    def _allocate_or_preempt(self, req: Request, num_new: int, output: SchedulerOutput) -> list[int] | None:
        """Preempts the newest running requests until `req` fits; None when `req` itself had to go."""
        while True:
            new_blocks = self.kv_cache.allocate(req.req_id, req.num_computed_tokens + num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self.kv_cache.free(victim.req_id)
            self.num_preemptions += 1
            victim.reset_for_recompute()
            self.waiting.appendleft(victim)
            output.finished_req_ids.add(victim.req_id)
            if victim is req:
                return None

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[bytes, EngineCoreOutputs]:
        """Appends sampled tokens, applies stop conditions, and cuts each request its own logprob rows."""
        sampled = dict(zip(runner_output.sampled_req_ids, runner_output.sampled_token_ids.tolist()))
        logprob_rows = {req_id: row for row, req_id in enumerate(runner_output.logprob_req_ids)}
        by_client: dict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        spec_counts: dict[bytes, dict[str, list[int]]] = defaultdict(dict)
        for req, error in self.failed:
            failure = EngineCoreOutput(req.client_req_id, [], finish_reason=FinishReason.ERROR, error=error)
            by_client[req.client_id].append(failure)
        self.failed = []
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            self._record_written(req, runner_output)
            if req_id in runner_output.pooled:  # a pooling request: its vector, and it is done
                req.finish(FinishReason.STOP)
                by_client[req.client_id].append(pooled_output(req, runner_output.pooled[req_id]))
                self._free(req)
                continue
            if req_id not in sampled:  # a prefill chunk that did not reach the last token
                if req_id in runner_output.hidden_states:  # its rows go now: a long prompt's are not held
                    chunk = EngineCoreOutput(req.client_req_id, [])
                    add_hidden_states(chunk, req, runner_output)
                    if chunk.extras is not None:
                        by_client[req.client_id].append(chunk)
                continue
            token_ids = sampled[req_id]
            if -1 in token_ids:  # a step that verified proposals: each row ends at its first -1
                token_ids = token_ids[: token_ids.index(-1)]
            num_drafts = runner_output.num_draft_tokens.get(req_id, 0)
            if num_drafts:
                self.speculation.record(req, num_drafts, len(token_ids) - 1)
            num_new = append_until_stop(req, token_ids, self.max_model_len)
            row = logprob_rows.get(req_id)
            step_logprobs = (
                [runner_output.logprobs[step] for step in range(num_new)] if row is not None else []
            )
            output = make_output(req, num_new, step_logprobs, row)
            if num_drafts:
                spec_counts[req.client_id][req.client_req_id] = [num_drafts, len(token_ids) - 1]
            add_token_extras(output, req_id, runner_output, num_new)
            add_hidden_states(output, req, runner_output)
            by_client[req.client_id].append(output)
            if req.is_finished:
                self._free(req)
        if any(r.is_finished for r in self.running):
            self.running = [r for r in self.running if not r.is_finished]
        return {
            client: EngineCoreOutputs(outputs, spec_counts=spec_counts.get(client))
            for client, outputs in by_client.items()
        }

    def _record_written(self, req: Request, runner_output: ModelRunnerOutput) -> None:
        """Keeps what the step computed for `req` beside its tokens (prompt logprob rows, routed
        experts) and indexes the blocks it wrote (their positions' tokens known), with their prompt rows:
        other requests may now read them."""
        chunk = runner_output.prompt_logprobs.get(req.req_id)
        if chunk is not None and not req.has_sent_prompt_logprobs:
            req.add_prompt_logprobs(chunk.token_ids, chunk.logprobs, chunk.ranks, chunk.candidate_ranks)
        if req.req_id in runner_output.routed_experts:
            req.add_routed_experts(runner_output.routed_experts[req.req_id])
        num_written = min(req.num_computed_tokens, req.num_tokens)
        indexed = self.kv_cache.cache_full_blocks(
            req.req_id, req.prompt_token_ids, req.output_token_ids, num_written, req.cache_salt,
            req.is_long_rope, self.loras.adapter_of(req.lora_slot) if req.lora_slot >= 0 else None,
        )
        flavour = flavour_of(req.params)
        if indexed and flavour is not None and not req.has_sent_prompt_logprobs:
            self.kv_cache.prompt_rows.store(indexed, req.prompt_logprob_parts, req.prompt_token_ids, flavour)

    def _fail(self, req: Request, error: str) -> None:
        """A request that cannot run (its grammar or its adapter): reported with the next outputs."""
        req.finish(FinishReason.ERROR)
        self.failed.append((req, error))
        self._free(req)

    def _free(self, req: Request) -> None:
        if req.lora_slot >= 0 and self.loras is not None and req.req_id in self.requests:
            self.loras.release(req.lora_slot)
        elif req.params.lora is not None and self.loras is not None and req.req_id in self.requests:
            self.loras.remove_waiter(req.params.lora)  # never admitted
        if req.grammar is not None and req.req_id in self.requests:
            self.num_with_grammar -= 1
        self.kv_cache.free(req.req_id)
        self.requests.pop(req.req_id, None)
        self.finished_req_ids.add(req.req_id)
