"""The worker's persistent view of the running requests and the per-step model inputs (core process).

The scheduler sends each request in full once, then only diffs; the runner appends its own sampled
tokens here, so token lists are never sent back down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from coreserve.protocol.sampling_params import SamplingParams
from coreserve.protocol.step import NewRequestData
from coreserve.worker.step.attention import AttentionMetadata, DecodeRows, SeqSpan


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
    is_logits: bool = False  # logprobs_mode "raw_logits" or "processed_logits": the values are logits
    is_long_rope: bool = False  # LongRoPE: every position rotates with the long factors (NewRequestData's)
    spec_seed: int | None = None  # speculative decoding: an unseeded sampled request's seed (the runner's)
    lora_slot: int = -1  # its loaded LoRA adapter (coreserve/worker/lora/); -1: none
    _table: np.ndarray | None = field(default=None, repr=False, compare=False)  # block_ids, cached

    def add_blocks(self, block_ids: list[int]) -> None:
        if block_ids:
            self.block_ids.extend(block_ids)
            self._table = None

    def block_table(self) -> np.ndarray:
        """[num_blocks] int32 view of block_ids, built once per change."""
        if self._table is None:
            self._table = np.asarray(self.block_ids, dtype=np.int32)
        return self._table

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
            data.logprobs_mode.startswith("processed"),  # "processed" (the old name) or "processed_*"
            data.eos_token_ids,
            is_logits=data.logprobs_mode.endswith("_logits"),
            is_long_rope=data.is_long_rope,
            lora_slot=data.lora_slot,
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
    first_position: int = 0  # the prompt position of the first row (row i predicts token i + 1)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    # [T] int64 each token's row of the RoPE tables: its position, plus long_rows_start for a request on
    # LongRoPE's long factors; `positions` itself where no token is
    rope_rows: torch.Tensor
    attn: AttentionMetadata
    sample_rows: torch.Tensor | None  # [R] int64 hidden rows whose logits are sampled; None: every row
    sampled_req_ids: list[str]  # [R]
    prompt_jobs: list[PromptLogprobsJob] = field(default_factory=list)
    lora_rows: torch.Tensor | None = None  # [T] int64 each token's LoRA slot (-1: none); None: no adapter


def build_step_inputs(
    states: list[RequestState],
    num_tokens: list[int],
    block_size: int,
    device: torch.device,
    verified: frozenset[str] = frozenset(),
    long_rows_start: int = 0,
) -> StepInputs:
    """Flattens the scheduled tokens of `states` (in batch order) into one varlen batch.
    Single-token rows with context (decode) are attended together, the rest (prefill chunks) one
    request at a time. A request in `verified` (speculative decoding: its last token and the proposals
    after it) has every token a decode row of its own, each sampled: the numbers of decoding them one
    by one, through the same kernels (the step's KV is written before any row attends).
    `long_rows_start`: the model's Rotary.long_rows_start (0: one set of RoPE rows)."""
    ids, positions, slots, sample_rows, sampled_req_ids, jobs, seqs = [], [], [], [], [], [], []
    decode_rows, decode_tables, decode_lens = [], [], []
    long_rows = []  # rows of the tokens of requests on LongRoPE's long factors
    row = 0
    for state, num in zip(states, num_tokens):
        start = state.num_computed_tokens
        end = start + num
        ids.extend(state.token_ids[start:end])
        positions.extend(range(start, end))
        if state.is_long_rope and long_rows_start:
            long_rows.extend(range(row, row + num))
        if state.req_id in verified:
            _add_verified_rows(state, start, end, row, block_size, slots, decode_rows, decode_tables, decode_lens)
            sample_rows.extend(range(row, row + num))
            sampled_req_ids.extend([state.req_id] * num)
            row += num
            continue
        if num == 1:
            slots.append(state.block_ids[start // block_size] * block_size + start % block_size)
        else:
            pos = np.arange(start, end)
            blocks = state.block_table()[pos // block_size].astype(np.int64)
            slots.extend((blocks * block_size + pos % block_size).tolist())
        if num == 1 and start > 0:
            decode_rows.append(row)
            decode_tables.append(state.block_table())
            decode_lens.append(end)
        else:
            seqs.append(SeqSpan(row, num, end, slot_runs(state.block_ids, end, block_size)))
        if end == len(state.token_ids):
            sample_rows.append(row + num - 1)
            sampled_req_ids.append(state.req_id)
        if state.prompt_logprobs_k is not None and start < state.num_prompt_tokens - 1:
            last = min(end, state.num_prompt_tokens - 1)
            jobs.append(
                PromptLogprobsJob(
                    state.req_id,
                    slice(row, row + last - start),
                    state.token_ids[start + 1 : last + 1],
                    state.prompt_logprobs_k,
                    start,
                )
            )
        row += num
    decode = None
    if decode_rows:
        decode = DecodeRows(
            block_size,
            np.asarray(decode_rows, dtype=np.int64),
            _stack_tables(decode_tables),
            np.asarray(decode_lens, dtype=np.int32),
        )
    position_tensor = torch.tensor(positions, dtype=torch.int64, device=device)
    return StepInputs(
        torch.tensor(ids, dtype=torch.int64, device=device),
        position_tensor,
        _rope_rows(position_tensor, long_rows, long_rows_start),
        AttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=device), seqs, decode),
        # every row in order (decode): no tensor to build, no hidden states to gather
        None
        if sample_rows == list(range(row))
        else torch.tensor(sample_rows, dtype=torch.int64, device=device),
        sampled_req_ids,
        jobs,
    )


def _add_verified_rows(
    state: RequestState,
    start: int,
    end: int,
    row: int,
    block_size: int,
    slots: list[int],
    decode_rows: list[int],
    decode_tables: list[np.ndarray],
    decode_lens: list[int],
) -> None:
    """Positions start..end - 1 of `state` as decode rows: each attends its own causal prefix."""
    table = state.block_table()
    for offset, position in enumerate(range(start, end)):
        slots.append(state.block_ids[position // block_size] * block_size + position % block_size)
        decode_rows.append(row + offset)
        decode_tables.append(table)
        decode_lens.append(position + 1)


def next_window_step(inputs: StepInputs, input_ids: torch.Tensor) -> StepInputs:
    """The inputs of a decode-only window's next step, derived on the device from this step's: every
    row one position further, fed the tokens just sampled, the backend's plan advanced by itself. No
    per-request Python, no host copy."""
    attn = inputs.attn
    assert attn.decode is not None and len(attn.decode.rows) == len(inputs.positions) and not attn.seqs
    assert attn.plan is not None  # the backend's prepare() ran on the window's first step
    positions = inputs.positions + 1
    rope_rows = positions if inputs.rope_rows is inputs.positions else inputs.rope_rows + 1
    decode = attn.decode.next_step()
    plan = attn.plan.next_step(decode)
    next_attn = AttentionMetadata(plan.next_slots(positions), [], decode, plan)
    return StepInputs(input_ids, positions, rope_rows, next_attn, inputs.sample_rows, inputs.sampled_req_ids,
                      lora_rows=inputs.lora_rows)


def _rope_rows(positions: torch.Tensor, long_rows: list[int], long_rows_start: int) -> torch.Tensor:
    """[T] each token's row of the RoPE tables: its position, moved past the short rows at `long_rows`."""
    if not long_rows:
        return positions
    rope_rows = positions.clone()
    rope_rows[torch.tensor(long_rows, device=positions.device)] += long_rows_start
    return rope_rows


def _stack_tables(tables: list[np.ndarray]) -> np.ndarray:
    """[R, max_blocks] int32, each row a request's block ids, zero padded."""
    stacked = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for i, table in enumerate(tables):
        stacked[i, : len(table)] = table
    return stacked


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
