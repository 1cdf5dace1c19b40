"""Prompt logprobs on the device: each prompt position's token with the top-k, and the caller's
candidate ids (prompt_logprob_token_ids), a slice of positions at a time (engine-core process)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from coreserve.worker.sampling.logprobs import SamplingOps, TopLogprobs, gather_logprobs
from coreserve.worker.step.input_batch import PromptLogprobsJob, RequestState
from coreserve.worker.step.step_tensors import LogprobsTensors

PROMPT_LOGITS_SLICE_ROWS = 256  # prompt positions per lm_head slice: bounds memory to rows x vocab floats


def prompt_logprob_rows(
    jobs: list[PromptLogprobsJob],
    by_id: dict[str, RequestState],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ops: SamplingOps,
) -> dict[str, LogprobsTensors]:
    """The step's prompt chunks' rows (StepInputs.prompt_jobs), by request; hidden: [T, H] the step's."""
    rows = {}
    for job in jobs:
        params = by_id[job.req_id].params
        targets = torch.tensor(job.target_ids, dtype=torch.int64, device=hidden.device)
        candidates = candidate_ids(
            params.prompt_logprob_token_ids, job.first_position, len(job.target_ids), hidden.device
        )
        triple = prompt_logprobs(
            hidden[job.hidden_rows], targets, job.k, compute_logits, ops, candidates,
            params.prompt_logprobs_temperature,
        )
        rows[job.req_id] = LogprobsTensors(*triple)
    return rows


def prompt_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ops: SamplingOps,
    candidates: torch.Tensor | None = None,
    temperature: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """hidden: [P, H] states of the positions before each target; targets: [P] next prompt tokens;
    candidates: [P, C] int64 ids scored too (prompt_logprob_token_ids), their columns after the top-k
    and their ranks [P, C] int32 a fourth tensor; temperature: the rows are logits / T.

    The vocabulary-wide logits are made a slice of rows at a time so long prompts stay bounded.
    """
    parts = []
    for start in range(0, hidden.shape[0], PROMPT_LOGITS_SLICE_ROWS):
        rows = slice(start, start + PROMPT_LOGITS_SLICE_ROWS)
        logits = compute_logits(hidden[rows])
        if temperature is not None:  # divided by a float32 tensor as the sampler does: the same bits
            logits = logits.float() / torch.full(
                (1, 1), temperature, dtype=torch.float32, device=logits.device
            )
        top = ops.top_logprobs(logits, k)
        part = gather_logprobs(top, targets[rows], k)
        if candidates is not None:
            part = with_candidates(top, part, candidates[rows])
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(column) for column in zip(*parts))


def with_candidates(
    top: TopLogprobs, part: tuple[torch.Tensor, ...], candidates: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """`part` (token_ids, values, ranks) with the candidates' [R, C] columns appended, taken from the same
    scores as column 0 (so a candidate that is the prompt token has its bits), and their ranks."""
    token_ids, values, ranks = part
    scores = top.scores.gather(-1, candidates)  # [R, C]
    # 1 + the tokens strictly above each candidate, as gather_logprobs counts: one sort per row, then
    # a search.
    ascending = top.scores.sort(dim=-1).values
    num_not_above = torch.searchsorted(ascending, scores.contiguous(), right=True)
    candidate_ranks = (top.scores.shape[-1] - num_not_above + 1).to(torch.int32)
    return (
        torch.cat((token_ids, candidates.to(torch.int32)), dim=-1),
        torch.cat((values, top.logprobs(scores)), dim=-1),
        ranks,
        candidate_ranks,
    )


def candidate_ids(
    rows: list[list[int]] | None, first_position: int, num_rows: int, device: torch.device
) -> torch.Tensor | None:
    """[num_rows, C] int64 candidates of prompt positions first_position.. (prompt_logprob_token_ids:
    one row for every position, or one per position); None when the request named none."""
    if rows is None:
        return None
    if len(rows) == 1:
        return torch.tensor(rows, dtype=torch.int64, device=device).expand(num_rows, -1)
    return torch.tensor(rows[first_position : first_position + num_rows], dtype=torch.int64, device=device)
