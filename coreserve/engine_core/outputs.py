"""Turns a request's new tokens and its logprob rows into the wire's EngineCoreOutput (core process).

Rows are sliced out of the step's arrays and trimmed to the request's own k: compact buffers, no Python
object per logprob.
"""

from __future__ import annotations

import numpy as np

from coreserve.engine_core.request import Request
from coreserve.protocol.arrays import LogprobsArrays, PooledArray, SamplingMaskArrays
from coreserve.protocol.messages import EngineCoreOutput, TokenExtras
from coreserve.protocol.step import HostLogprobs, ModelRunnerOutput


def make_output(
    req: Request, num_new: int, step_logprobs: list[HostLogprobs], row: int | None
) -> EngineCoreOutput:
    output = EngineCoreOutput(req.client_req_id, req.output_token_ids[-num_new:] if num_new else [])
    if step_logprobs:
        output.new_logprobs = _rows_for(req.params.logprobs, step_logprobs, row)
    if not req.has_sent_prompt_logprobs and req.num_output_tokens > 0:
        output.prompt_logprobs = _prompt_logprobs(req)
        req.has_sent_prompt_logprobs = True
        req.prompt_logprob_parts = []
    routed = req.take_routed_experts() if req.params.return_routed_experts else None
    if routed is not None:
        _extras(output).routed_experts = routed
    if req.num_output_tokens == num_new:  # the first output: what the prefix cache saved
        output.num_cached_tokens = req.num_cached_tokens
    if req.is_finished:
        output.finish_reason = req.finish_reason
        output.stop_reason = req.stop_reason
    return output


def pooled_output(req: Request, values: np.ndarray) -> EngineCoreOutput:
    """A finished pooling request's one output: no tokens, its vector (runner="pooling")."""
    output = EngineCoreOutput(req.client_req_id, [], finish_reason=req.finish_reason)
    _extras(output).pooled = PooledArray.from_numpy(values)
    return output


def add_hidden_states(output: EngineCoreOutput, req: Request, step: ModelRunnerOutput) -> None:
    """The step's hidden-state rows `req` is owed (return_hidden_states), as soon as they are computed."""
    parts = step.hidden_states.get(req.req_id)
    rows = req.take_hidden_states(parts) if parts else None
    if rows is not None:
        _extras(output).hidden_states = rows


def add_token_extras(output: EngineCoreOutput, req_id: str, step: ModelRunnerOutput, num_new: int) -> None:
    """What the step computed per sampled row beside the tokens (grammar masses, sampling supports),
    one per kept token: rows past a stop or a rejected proposal are dropped."""
    if req_id in step.constraint_masses:
        _extras(output).constraint_masses = step.constraint_masses[req_id][:num_new]
    if req_id in step.sampling_masks:
        _extras(output).sampling_mask = SamplingMaskArrays.from_rows(step.sampling_masks[req_id][:num_new])


def _extras(output: EngineCoreOutput) -> TokenExtras:
    if output.extras is None:
        output.extras = TokenExtras()
    return output.extras


def _rows_for(k: int, step_logprobs: list[HostLogprobs], row: int) -> LogprobsArrays:
    num_cols = None if k == -1 else k + 1
    if len(step_logprobs) == 1:
        lp = step_logprobs[0]
        return LogprobsArrays.from_numpy(
            lp.token_ids[row : row + 1, :num_cols],
            lp.logprobs[row : row + 1, :num_cols],
            lp.ranks[row : row + 1],
        )
    return LogprobsArrays.from_numpy(
        np.stack([lp.token_ids[row, :num_cols] for lp in step_logprobs]),
        np.stack([lp.logprobs[row, :num_cols] for lp in step_logprobs]),
        np.array([lp.ranks[row] for lp in step_logprobs], dtype=np.int32),
    )


def _prompt_logprobs(req: Request) -> LogprobsArrays:
    if not req.prompt_logprob_parts:  # a one-token prompt has no prompt logprob rows
        num_candidates = len((req.params.prompt_logprob_token_ids or [[]])[0])
        width = (1 if req.params.prompt_logprobs == -1 else req.params.prompt_logprobs + 1) + num_candidates
        empty = np.zeros((0, width), dtype=np.int32)
        candidate_ranks = np.zeros((0, num_candidates), dtype=np.int32) if num_candidates else None
        return LogprobsArrays.from_numpy(
            empty, empty.astype(np.float32), np.zeros(0, dtype=np.int32), candidate_ranks
        )
    return _concat_logprobs(req.prompt_logprob_parts)


def _concat_logprobs(parts: list[LogprobsArrays]) -> LogprobsArrays:
    """Stacks row blocks of the same width (e.g. prompt logprobs computed chunk by chunk)."""
    if len(parts) == 1:
        return parts[0]
    candidate_ranks = [p.candidate_ranks_np() for p in parts]
    return LogprobsArrays.from_numpy(
        np.concatenate([p.token_ids_np() for p in parts]),
        np.concatenate([p.logprobs_np() for p in parts]),
        np.concatenate([p.ranks_np() for p in parts]),
        None if candidate_ranks[0] is None else np.concatenate(candidate_ranks),
    )
