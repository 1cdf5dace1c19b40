"""The worker's persistent view of the running requests and the per-step model inputs (core process).

The scheduler sends each request in full once, then only diffs; the runner appends its own sampled
tokens here, so token lists are never sent back down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from protocol.sampling_params import SamplingParams
from protocol.step import NewRequestData
from worker.attention import AttentionMetadata, SeqSpan


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs_k: int | None
    logprobs_k: int | None
    is_processed: bool
    eos_token_ids: list[int]

    @classmethod
    def from_new(cls, data: NewRequestData) -> RequestState:
        return cls(
            data.req_id,
            list(data.token_ids),
            data.num_prompt_tokens,
            data.sampling_params,
            list(data.block_ids),
            data.num_computed_tokens,
            data.prompt_logprobs_k,
            data.logprobs_k,
            data.logprobs_mode == "processed",
            data.eos_token_ids,
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class PromptLogprobsJob:
    req_id: str
    hidden_rows: slice  # rows of this step's hidden states whose next token is a prompt token
    target_ids: list[int]  # [rows] the prompt tokens they predict
    k: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [R] int64 hidden rows whose logits are sampled
    sampled_req_ids: list[str]  # [R]
    prompt_jobs: list[PromptLogprobsJob] = field(default_factory=list)


def build_step_inputs(
    states: list[RequestState], num_tokens: list[int], block_size: int, device: torch.device
) -> StepInputs:
    """Flattens the scheduled tokens of `states` (in batch order) into one varlen batch."""
    ids, positions, slots, sample_rows, sampled_req_ids, jobs, seqs = [], [], [], [], [], [], []
    row = 0
    for state, num in zip(states, num_tokens):
        start = state.num_computed_tokens
        pos = np.arange(start, start + num)
        table = np.asarray(state.block_ids, dtype=np.int64)
        ids.extend(state.token_ids[start : start + num])
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        seqs.append(SeqSpan(row, num, start + num, slot_runs(state.block_ids, start + num, block_size)))
        if start + num == len(state.token_ids):
            sample_rows.append(row + num - 1)
            sampled_req_ids.append(state.req_id)
        if state.prompt_logprobs_k is not None and start < state.num_prompt_tokens - 1:
            end = min(start + num, state.num_prompt_tokens - 1)
            jobs.append(
                PromptLogprobsJob(
                    state.req_id,
                    slice(row, row + end - start),
                    state.token_ids[start + 1 : end + 1],
                    state.prompt_logprobs_k,
                )
            )
        row += num
    return StepInputs(
        torch.tensor(ids, dtype=torch.int64, device=device),
        torch.from_numpy(np.concatenate(positions)).to(device),
        AttentionMetadata(torch.from_numpy(np.concatenate(slots)).to(device), seqs),
        torch.tensor(sample_rows, dtype=torch.int64, device=device),
        sampled_req_ids,
        jobs,
    )


def slot_runs(block_ids: list[int], num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """The slots of positions 0..num_tokens - 1 as (first slot, count) runs of adjacent blocks."""
    runs: list[list[int]] = []
    remaining = num_tokens
    for block in block_ids[: -(-num_tokens // block_size)]:
        count = min(block_size, remaining)
        if runs and runs[-1][0] + runs[-1][1] == block * block_size:
            runs[-1][1] += count
        else:
            runs.append([block * block_size, count])
        remaining -= count
    return [(first, count) for first, count in runs]
