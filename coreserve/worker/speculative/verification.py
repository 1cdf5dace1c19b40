"""Verification of proposals (engine-core process): a request's last token and its d proposed tokens
run as d + 1 decode rows of one step (coreserve/worker/step/input_batch.py), each sampled as the decode step at that
position would be, and the longest run of proposals the model's own samples agree with is kept, with
the model's sample after it. Batch invariance makes each row's logits the bits of decoding it alone,
and the sampler's noise is a function of (seed, output position) only, so the kept tokens and their
logprob rows are those of plain decoding, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from coreserve.protocol.step import HostLogprobs
from coreserve.worker.step.input_batch import RequestState
from coreserve.worker.step.step_tensors import HostStep, LogprobsTensors, copy_to_host


@dataclass
class Verification:
    """This step's proposals: req_id -> the proposed tokens, appended to its token list while it runs."""

    drafts: dict[str, list[int]]

    @property
    def req_ids(self) -> frozenset[str]:
        return frozenset(self.drafts)

    def row_states(self, states: list[RequestState], sampled_req_ids: list[str]) -> list[RequestState]:
        """One state per sampled row, as the sampler reads it: a verified request's row j sees its
        tokens up to proposal j (its output position, penalties and min_tokens bans are row j's)."""
        by_id = {s.req_id: s for s in states}
        rows, seen = [], {}
        for req_id in sampled_req_ids:
            state = by_id[req_id]
            if req_id not in self.drafts:
                rows.append(state)
                continue
            j = seen.get(req_id, 0)
            seen[req_id] = j + 1
            num_drafts = len(self.drafts[req_id])
            end = len(state.token_ids) - num_drafts + j
            rows.append(replace(state, token_ids=state.token_ids[:end], _table=None))
        return rows


def accept(
    verification: Verification, states: list[RequestState], sampled_req_ids: list[str], sampled: list[int]
) -> dict[str, list[int]]:
    """Per sampling request, the tokens it keeps: a verified one its agreeing proposals and the model's
    next token; the states' token lists take them (the proposals are taken off first)."""
    kept: dict[str, list[int]] = {}
    row = 0
    by_id = {s.req_id: s for s in states}
    while row < len(sampled_req_ids):
        req_id = sampled_req_ids[row]
        drafts = verification.drafts.get(req_id, [])
        samples = sampled[row : row + len(drafts) + 1]
        num_kept = 0
        while num_kept < len(drafts) and samples[num_kept] == drafts[num_kept]:
            num_kept += 1
        tokens = samples[: num_kept + 1]
        state = by_id[req_id]
        if drafts:
            del state.token_ids[-len(drafts) :]
        state.token_ids.extend(tokens)
        kept[req_id] = tokens
        row += len(drafts) + 1
    return kept


def kept_output(
    kept: dict[str, list[int]],
    sampled_req_ids: list[str],
    logprob_req_ids: list[str],
    logprobs: LogprobsTensors | None,
    prompt_logprobs: dict[str, HostLogprobs],
) -> HostStep:
    """The step in the multi-step shape the scheduler reads: tokens [requests, most kept] padded with
    -1, and per kept position the logprob rows of the requests that asked (a request past its own kept
    tokens repeats its last row there; the scheduler reads no row past a request's tokens); the
    step's prompt logprob rows as they came."""
    order = list(dict.fromkeys(sampled_req_ids))
    num_steps = max(len(kept[r]) for r in order)
    tokens = np.full((len(order), num_steps), -1, dtype=np.int32)
    for i, req_id in enumerate(order):
        tokens[i, : len(kept[req_id])] = kept[req_id]
    steps = []
    if logprobs is not None:
        wanted = set(logprob_req_ids)
        first_row, row = {}, 0  # the logprob rows follow the sampled rows of the requests that asked
        for req_id in sampled_req_ids:
            if req_id in wanted:
                first_row.setdefault(req_id, row)
                row += 1
        index = torch.tensor(
            [[first_row[r] + min(step, len(kept[r]) - 1) for r in logprob_req_ids] for step in range(num_steps)],
            dtype=torch.int64,
            device=logprobs.token_ids.device,
        )
        host = copy_to_host([tensor[index] for tensor in logprobs.present()])  # [steps, requests, ...] each
        steps = [HostLogprobs(*(array[step] for array in host)) for step in range(num_steps)]
    return HostStep(tokens, steps, prompt_logprobs)
