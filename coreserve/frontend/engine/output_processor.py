"""Follows each request's outputs from the core: text, stop strings, logprobs; builds RequestOutputs
(frontend process). A user request with n > 1 is n core requests, one per completion.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from coreserve.frontend.engine.completion_text import append_tokens
from coreserve.frontend.engine.logprob_rows import add_chosen, to_position_dicts
from coreserve.frontend.engine.token_extras import apply_extras, hidden_states, routed_experts
from coreserve.frontend.engine.token_text import IncrementalDetokenizer, TokenIdsOnly, TokenTable
from coreserve.frontend.errors import EngineDeadError, RequestFailedError
from coreserve.frontend.outputs import CompletionOutput, PositionLogprobs, RequestOutput, SamplingMask
from coreserve.frontend.pooling_outputs import PoolingOutput, PoolingRequestOutput
from coreserve.frontend.request_ids import child_params
from coreserve.protocol.messages import EngineCoreOutput, FinishReason
from coreserve.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class CompletionState:
    core_req_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | TokenIdsOnly
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    text_end: int | None = None  # where a stop string cut the text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # streaming: what earlier deltas already carried
    num_sent_chars: int = 0
    has_sent_finish: bool = False  # streaming: a finished completion is in one delta, never after
    constraint_masses: list[float] | None = None  # grammar requests with logprobs: one per token
    routed_parts: list[np.ndarray] | None = None  # return_routed_experts: the core's rows, in order
    mask_rows: list[np.ndarray] | None = None  # return_sampling_mask: one support per kept token
    hidden_parts: list[np.ndarray] | None = None  # return_hidden_states: the core's rows, in order
    pooled: np.ndarray | None = None  # a pooling request's vector (runner="pooling"), in its one output

    def routed_experts(self, num_prompt_tokens: int) -> np.ndarray | None:
        return routed_experts(self.routed_parts, num_prompt_tokens + len(self.token_ids) - 1)

    def hidden_states(self, num_prompt_tokens: int) -> np.ndarray | None:
        which = self.params.hidden_states_positions
        return hidden_states(self.hidden_parts, which, num_prompt_tokens, len(self.token_ids))

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.text_end is None else self.detokenizer.text[: self.text_end]

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionState]
    is_delta: bool  # streaming: each output carries only what is new
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    has_sent_prompt_logprobs: bool = False  # streaming: they travel in the first delta only
    metrics: dict[str, float] = field(default_factory=dict)
    error: Exception | None = None  # the core refused it, handling its output failed, or its core died
    num_cached_tokens: int = 0
    weight_version: int = 0  # the core's weights behind its latest output (docs/rl.md)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]  # to hand out: deltas when streaming, else finished requests only
    to_abort: list[str]  # core request ids to abort (a stop string ended them, or their request failed)
    errors: dict[str, Exception] = field(default_factory=dict)  # request id -> its failure (finished)


class OutputProcessor:
    def __init__(self, table: TokenTable) -> None:
        self.table = table
        self.requests: dict[str, RequestState] = {}
        self.completion_of: dict[str, CompletionState] = {}  # core req id -> completion
        self.owner_of: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        is_delta: bool = False,
    ) -> list[tuple[str, SamplingParams]]:
        """Registers a submission (`request_id`: its submission id, made by FrontendEngine.prepare);
        returns the (core request id, params) of each of its completions. Core ids are unique per
        submission, so late outputs of an aborted request can never reach a new request that reuses
        its id."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        children = child_params(request_id, params)
        completions = [
            CompletionState(
                core_req_id=core_id,
                index=i,
                params=p,
                detokenizer=IncrementalDetokenizer(self.table, p.skip_special_tokens, p.spaces_between_special_tokens)
                if p.detokenize else TokenIdsOnly(),
                logprobs=[] if p.logprobs is not None else None,
                cumulative_logprob=0.0 if p.logprobs is not None else None,
                constraint_masses=[] if p.logprobs is not None and p.structured_outputs is not None else None,
                routed_parts=[] if p.return_routed_experts else None,
                mask_rows=[] if p.return_sampling_mask else None,
                hidden_parts=[] if p.hidden_indices is not None else None,
            )
            for i, (core_id, p) in enumerate(children)
        ]
        state = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            completions=completions,
            is_delta=is_delta,
            metrics={"arrival_time": time.time()},
        )
        self.requests[request_id] = state
        for completion in completions:
            self.completion_of[completion.core_req_id] = completion
            self.owner_of[completion.core_req_id] = state
        return children

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def process(
        self,
        outputs: list[EngineCoreOutput],
        lost: dict[str, str] | None = None,
        spec_counts: dict[str, list[int]] | None = None,
    ) -> ProcessedOutputs:
        """Applies the core's outputs. A request whose output cannot be handled, that the core refused,
        or that was `lost` with its core (core request id -> why) fails alone: it is finished, its
        other completions aborted, and its error returned."""
        touched: dict[str, RequestState] = {}
        result = ProcessedOutputs([], [])
        for core_req_id, reason in (lost or {}).items():
            state = self.owner_of.get(core_req_id)
            if state is not None and state.error is None:
                state.error = EngineDeadError(reason)
                result.to_abort.extend(self._fail(state))
                result.errors[state.request_id] = state.error
                touched[state.request_id] = state
        for core_req_id, (proposed, kept) in (spec_counts or {}).items():
            state = self.owner_of.get(core_req_id)
            if state is not None:  # speculative decoding, per request (its completions together)
                metrics = state.metrics
                metrics["spec_num_draft_tokens"] = metrics.get("spec_num_draft_tokens", 0) + proposed
                metrics["spec_num_accepted_tokens"] = metrics.get("spec_num_accepted_tokens", 0) + kept
        for output in outputs:
            completion = self.completion_of.get(output.req_id)
            if completion is None:
                continue  # already finished here (stop string, failure) while the core was still running it
            state = self.owner_of[output.req_id]
            try:
                if self._apply(state, completion, output):
                    result.to_abort.append(completion.core_req_id)
            except Exception as exc:  # a bug or an id the tokenizer cannot handle: this request only
                logger.exception("could not handle an output of request %s", state.request_id)
                state.error = RequestFailedError(f"handling the engine's output failed: {exc!r}")
            if state.error is not None:
                result.to_abort.extend(self._fail(state))
                result.errors[state.request_id] = state.error
            elif completion.finish_reason is not None:
                del self.completion_of[output.req_id], self.owner_of[output.req_id]
            elif not output.new_token_ids and output.finish_reason is None:
                continue  # a prompt chunk's hidden states: kept until the completion has news
            touched[state.request_id] = state
        for state in touched.values():
            if state.finished:
                self.requests.pop(state.request_id, None)
                state.metrics["finished_time"] = time.time()
            if state.error is None and (state.is_delta or state.finished):  # whole outputs per step: O(n^2)
                result.outputs.append(make_request_output(state))
        return result

    def _fail(self, state: RequestState) -> list[str]:
        """Finishes every completion of a failed request; returns the core ids still running."""
        running = []
        for completion in state.completions:
            self.completion_of.pop(completion.core_req_id, None)
            self.owner_of.pop(completion.core_req_id, None)
            if completion.finish_reason is None:
                completion.finish_reason = str(FinishReason.ERROR)
                running.append(completion.core_req_id)
        return running

    def abort(self, request_id: str) -> tuple[list[str], RequestOutput | None]:
        """Finishes a user request as aborted; returns its unfinished core request ids and its last output."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return [], None
        ids = [c.core_req_id for c in state.completions if c.finish_reason is None]
        for completion in state.completions:
            if completion.finish_reason is None:
                completion.finish_reason = str(FinishReason.ABORT)
        for core_id in ids:
            self.completion_of.pop(core_id, None)
            self.owner_of.pop(core_id, None)
        return ids, make_request_output(state)

    def _apply(self, state: RequestState, completion: CompletionState, output: EngineCoreOutput) -> bool:
        """Returns True when a stop string finished a completion the core is still running."""
        if "first_token_time" not in state.metrics and output.new_token_ids:
            state.metrics["first_token_time"] = time.time()
        state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
        state.weight_version = max(state.weight_version, output.weight_version)
        if output.prompt_logprobs is not None:
            detokenize = completion.params.detokenize
            state.prompt_logprobs = [None] + to_position_dicts(output.prompt_logprobs, self.table, detokenize=detokenize)
        is_core_done = output.finish_reason is not None
        num_kept, is_stopped = append_tokens(completion, output)
        if output.new_logprobs is not None and completion.logprobs is not None:
            is_masked = completion.params.structured_outputs is not None  # its -inf entries are not shown
            positions = to_position_dicts(
                output.new_logprobs, self.table, drop_masked=is_masked, detokenize=completion.params.detokenize
            )
            completion.logprobs.extend(positions[:num_kept])
            completion.cumulative_logprob = add_chosen(
                completion.cumulative_logprob, output.new_logprobs, num_kept
            )
        if output.extras is not None:
            apply_extras(completion, output.extras, num_kept)
        if is_core_done and not is_stopped:
            completion.finish_reason = str(output.finish_reason)
            completion.stop_reason = output.stop_reason
            if output.finish_reason == FinishReason.ERROR:
                state.error = RequestFailedError(output.error or "the engine core failed it without a reason")
        return is_stopped and not is_core_done

def make_request_output(state: RequestState) -> RequestOutput | PoolingRequestOutput:
    """A pooling request's PoolingRequestOutput (its one output, finished); else: streaming with n > 1: a delta carries only the completions this step changed (new tokens or
    text, or the finish), so that a finished completion is never sent again; n = 1 always has its one."""
    pooled = state.completions[0].pooled
    if pooled is not None or state.completions[0].params.pooling is not None:
        return PoolingRequestOutput(state.request_id, PoolingOutput(pooled), state.prompt_token_ids, state.finished)
    is_parent = len(state.completions) > 1
    num_prompt = len(state.prompt_token_ids)
    completions = [_completion_output(c, state.is_delta, is_parent, num_prompt) for c in state.completions]
    completions = [c for c in completions if c is not None]
    prompt_logprobs = state.prompt_logprobs
    if state.is_delta:  # the first delta that has them carries them; later deltas carry None
        prompt_logprobs = None if state.has_sent_prompt_logprobs else prompt_logprobs
        state.has_sent_prompt_logprobs = state.has_sent_prompt_logprobs or prompt_logprobs is not None
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=completions,
        finished=state.finished,
        metrics=dict(state.metrics),
        num_cached_tokens=state.num_cached_tokens,
        weight_version=state.weight_version,
    )


def _completion_output(
    c: CompletionState, is_delta: bool, can_skip: bool, num_prompt: int
) -> CompletionOutput | None:
    """The whole completion, or (streaming) what is new since the last delta: None when nothing is.
    Routed experts and hidden states: whole, in the finished completion (streaming: its finishing delta)."""
    if not is_delta:
        return CompletionOutput(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            constraint_masses=None if c.constraint_masses is None else list(c.constraint_masses),
            routed_experts=c.routed_experts(num_prompt) if c.finish_reason is not None else None,
            sampling_mask=None if c.mask_rows is None else SamplingMask.of(c.mask_rows),
            hidden_states=c.hidden_states(num_prompt) if c.finish_reason is not None else None,
        )
    text = c.text
    if c.finish_reason is None and c.params.stop:  # hold back what could still become a stop string
        text = text[: max(c.num_sent_chars, len(text) - max(len(s) for s in c.params.stop) + 1)]
    token_ids = c.token_ids[c.num_sent_tokens :]
    logprobs = c.logprobs[c.num_sent_tokens :] if c.logprobs is not None else None
    is_new_finish = c.finish_reason is not None and not c.has_sent_finish
    if can_skip and not token_ids and len(text) == c.num_sent_chars and not is_new_finish:
        return None
    delta = CompletionOutput(
        index=c.index,
        text=text[c.num_sent_chars :],
        token_ids=token_ids,
        cumulative_logprob=c.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        constraint_masses=None if c.constraint_masses is None else c.constraint_masses[c.num_sent_tokens :],
        routed_experts=c.routed_experts(num_prompt) if is_new_finish else None,
        sampling_mask=None if c.mask_rows is None else SamplingMask.of(c.mask_rows[c.num_sent_tokens :]),
        hidden_states=c.hidden_states(num_prompt) if is_new_finish else None,
    )
    c.num_sent_tokens, c.num_sent_chars = len(c.token_ids), len(text)
    c.has_sent_finish = c.finish_reason is not None
    return delta
