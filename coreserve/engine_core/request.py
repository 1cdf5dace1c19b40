"""A request as the core sees it: its tokens, progress and status; it changes only its own lists."""

from __future__ import annotations

import enum

import numpy as np

from coreserve.engine_core.prompt_rows import flavour_of
from coreserve.protocol.arrays import HiddenStates, LogprobsArrays, RoutedExperts
from coreserve.protocol.messages import FinishReason
from coreserve.protocol.sampling_params import SamplingParams
from coreserve.protocol.step import NewRequestData


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Request:
    def __init__(
        self,
        *,
        req_id: str,
        client_id: bytes,
        client_req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        eos_token_ids: list[int],
        logprobs_mode: str,
    ) -> None:
        self.req_id = req_id  # unique in the core: the client's id qualified by the client
        self.client_id = client_id
        self.client_req_id = client_req_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.arrival_time = arrival_time
        self.eos_token_ids = [] if params.ignore_eos else eos_token_ids
        self.logprobs_mode = params.logprobs_mode or logprobs_mode
        self.max_tokens = params.max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens read from the prefix cache at admission
        # LongRoPE: its KV rotated with the long factors, every position (the scheduler's choice, by its
        # length: coreserve/engine_core/scheduler.py); False: the short ones, or no LongRoPE
        self.is_long_rope = False
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.prompt_logprob_parts: list[LogprobsArrays] = []  # chunks until the first sampled token
        self.has_sent_prompt_logprobs = params.prompt_logprobs is None
        self.grammar = None  # coreserve/engine_core/grammars.py's RequestGrammar, for structured outputs
        # Speculative decoding (coreserve/engine_core/speculation.py): its proposal length now, the rounds in a row
        # that kept no proposed token, the steps left without proposals; tokens proposed and kept in all
        self.spec_k = 0
        self.spec_misses = 0
        self.spec_pause = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # return_routed_experts: rows by position as the steps computed them (a later step's rows for a
        # position replace an earlier one's: rejected proposals, recomputation), and how many were sent
        self.routed_experts: np.ndarray | None = None  # [positions, MoE layers, top_k] int16
        self.num_routed_sent = 0
        # return_hidden_states: the next position whose row is owed (the rows go out as they come: a
        # recompute's rows of positions already sent are dropped)
        self.next_hidden_position = self.num_prompt_tokens - 1 if params.hidden_states_positions == "output" else 0
        self.lora_slot = -1  # its adapter's load (coreserve/engine_core/lora_table.py), held to its end; -1: none

    @property
    def cache_salt(self) -> str | tuple[str, int, str | None] | None:
        """What the prefix cache keys its chain's root by (PrefixIndex.root_of): the params' cache_salt,
        and a LoRA request's adapter load, so its KV meets only that load's."""
        salt = self.params.cache_salt
        return salt if self.lora_slot < 0 else ("lora", self.lora_slot, salt)

    @property
    def can_read_prefix_cache(self) -> bool:
        """Routed experts come from computing each position: such a request computes all of its prompt.
        Prompt logprobs owed are read with the blocks that keep them (coreserve/engine_core/prompt_rows.py), for
        the flavours kept there; candidate ids are computed."""
        params = self.params
        if params.return_routed_experts:
            return False
        if params.hidden_indices is not None and self.next_hidden_position < self._hidden_cache_end:
            return False  # hidden states still owed at positions the cache would skip: computed, not read
        return self.has_sent_prompt_logprobs or (
            flavour_of(params) is not None and params.prompt_logprob_token_ids is None
        )

    @property
    def _hidden_cache_end(self) -> int:
        """The end of the positions a cached prefix could cover (never the last token) that the request
        may want hidden states of."""
        wanted_end = self.num_prompt_tokens if self.params.hidden_states_positions == "prompt" else self.num_tokens
        return min(wanted_end, self.num_tokens - 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def new_request_data(self, block_ids: list[int], state_snapshot: int = -1) -> NewRequestData:
        """What the worker is told when it first runs the request, or again after a preemption;
        `state_snapshot`: a hybrid model's snapshot slot its cached prefix restores (-1: none)."""
        params = self.params
        return NewRequestData(
            req_id=self.req_id,
            token_ids=self.all_token_ids,
            num_prompt_tokens=self.num_prompt_tokens,
            sampling_params=params,
            block_ids=list(block_ids),
            num_computed_tokens=self.num_computed_tokens,
            prompt_logprobs_k=None if self.has_sent_prompt_logprobs else params.prompt_logprobs,
            logprobs_k=params.logprobs,
            logprobs_mode=self.logprobs_mode,
            eos_token_ids=self.eos_token_ids,
            is_long_rope=self.is_long_rope,
            lora_slot=self.lora_slot,
            state_snapshot=state_snapshot,
        )

    def add_prompt_logprobs(
        self,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        ranks: np.ndarray,
        candidate_ranks: np.ndarray | None = None,
    ) -> None:
        self.prompt_logprob_parts.append(
            LogprobsArrays.from_numpy(token_ids, logprobs, ranks, candidate_ranks)
        )

    def add_routed_experts(self, parts: list[tuple[int, np.ndarray]]) -> None:
        for first, rows in parts:
            end = first + len(rows)
            if self.routed_experts is None or len(self.routed_experts) < end:
                grown = np.zeros((max(end, 2 * self.num_tokens), *rows.shape[1:]), dtype=np.int16)
                if self.routed_experts is not None:
                    grown[: len(self.routed_experts)] = self.routed_experts
                self.routed_experts = grown
            self.routed_experts[first:end] = rows

    def take_routed_experts(self) -> RoutedExperts | None:
        """The rows of the positions computed and not sent yet: every token but the last (a sampled
        token is computed when the next step feeds it)."""
        end = self.num_tokens - 1
        if self.routed_experts is None or end <= self.num_routed_sent:
            return None
        first, self.num_routed_sent = self.num_routed_sent, end
        return RoutedExperts.from_numpy(first, self.routed_experts[first:end])

    def take_hidden_states(self, parts: list[tuple[int, np.ndarray]]) -> HiddenStates | None:
        """The rows of `parts` (a step's, each (first position, [indices, rows, hidden])) at positions
        owed: not sent yet, and computed for a token kept (every token's but the last one's)."""
        end, kept = self.num_tokens - 1, []
        for first, rows in parts:
            low, high = max(first, self.next_hidden_position), min(first + rows.shape[1], end)
            if low < high:
                assert low == self.next_hidden_position, "hidden state rows skip a position"
                kept.append(rows[:, low - first : high - first])
                self.next_hidden_position = high
        if not kept:
            return None
        first = self.next_hidden_position - sum(part.shape[1] for part in kept)
        return HiddenStates.from_numpy(first, kept[0] if len(kept) == 1 else np.concatenate(kept, axis=1))

    def reset_for_recompute(self) -> None:
        """Preempted: its KV is gone; prompt logprob chunks not yet sent are computed again."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        if not self.has_sent_prompt_logprobs:
            self.prompt_logprob_parts.clear()

    def finish(self, reason: FinishReason, stop_reason: int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
