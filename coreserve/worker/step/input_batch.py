"""The worker's persistent view of the running requests and the per-step model inputs (core process).

The scheduler sends each request in full once, then only diffs; the runner appends its own sampled
tokens here, so token lists are never sent back down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from coreserve.protocol.pooling_params import PoolingParams
from coreserve.protocol.sampling_params import SamplingParams
from coreserve.protocol.step import NewRequestData
from coreserve.worker.step.attention import AttentionMetadata, DecodeRows, SeqSpan, StateSpan


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
    state_slot: int = -1  # a hybrid model's: its slot of the recurrent state cache (kv_memory.py); -1: none
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


@dataclass(frozen=True)
class PoolJob:
    """A pooling request whose whole prompt the step computes (runner="pooling"): its rows of the step's
    hidden states, pooled after the forward (coreserve/worker/pooling/pooler.py) instead of sampled."""

    req_id: str
    first_row: int
    num_rows: int
    token_ids: list[int]  # its prompt (a classifier's pad rule reads it)
    params: PoolingParams


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
    pool_jobs: list[PoolJob] = field(default_factory=list)  # runner="pooling": the prompts pooled this step


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
    rows = _StepRows(block_size)
    for state, num in zip(states, num_tokens):
        rows.add(state, num, state.req_id in verified, state.is_long_rope and long_rows_start != 0)
    return rows.to_inputs(device, long_rows_start)


@dataclass
class _StepRows:
    """The host lists of one step's inputs, filled request by request in batch order; `row` is the
    next token's row."""

    block_size: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    long_rows: list[int] = field(default_factory=list)  # rows of requests on LongRoPE's long factors
    seqs: list[SeqSpan] = field(default_factory=list)  # prefill chunks, each attended on its own
    decode_rows: list[int] = field(default_factory=list)  # single rows with context, attended together
    decode_tables: list[np.ndarray] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sampled_req_ids: list[str] = field(default_factory=list)
    prompt_jobs: list[PromptLogprobsJob] = field(default_factory=list)
    state_spans: list[StateSpan] = field(default_factory=list)
    pool_jobs: list[PoolJob] = field(default_factory=list)
    row: int = 0

    def add(self, state: RequestState, num: int, is_verified: bool, is_long: bool) -> None:
        start, end = state.num_computed_tokens, state.num_computed_tokens + num
        self.input_ids.extend(state.token_ids[start:end])
        self.positions.extend(range(start, end))
        if is_long:
            self.long_rows.extend(range(self.row, self.row + num))
        if state.state_slot >= 0:
            self.state_spans.append(StateSpan(self.row, num, state.state_slot))
        if is_verified:
            self.add_verified(state, start, end)
        else:
            self.add_slots(state, start, end)
            self.add_attention(state, start, end)
            self.add_sampled(state, start, end)
            self.add_prompt_job(state, start, end)
        self.row += num

    def add_verified(self, state: RequestState, start: int, end: int) -> None:
        """Positions start..end - 1 as decode rows, each attending its own causal prefix, each sampled."""
        table, size = state.block_table(), self.block_size
        for offset, position in enumerate(range(start, end)):
            self.slots.append(state.block_ids[position // size] * size + position % size)
            self.decode_rows.append(self.row + offset)
            self.decode_tables.append(table)
            self.decode_lens.append(position + 1)
        self.sample_rows.extend(range(self.row, self.row + end - start))
        self.sampled_req_ids.extend([state.req_id] * (end - start))

    def add_slots(self, state: RequestState, start: int, end: int) -> None:
        """Where positions start..end - 1 write their KV."""
        size = self.block_size
        if end - start == 1:
            self.slots.append(state.block_ids[start // size] * size + start % size)
        else:
            pos = np.arange(start, end)
            blocks = state.block_table()[pos // size].astype(np.int64)
            self.slots.extend((blocks * size + pos % size).tolist())

    def add_attention(self, state: RequestState, start: int, end: int) -> None:
        """A decode row (one token with context) joins the others; a prefill chunk is a span of its own."""
        if end - start == 1 and start > 0:
            self.decode_rows.append(self.row)
            self.decode_tables.append(state.block_table())
            self.decode_lens.append(end)
        else:
            runs = slot_runs(state.block_ids, end, self.block_size)
            self.seqs.append(SeqSpan(self.row, end - start, end, runs))

    def add_sampled(self, state: RequestState, start: int, end: int) -> None:
        """A request whose last token is scheduled samples from its last row; a pooling request's whole
        prompt (scheduled in one step) is pooled instead."""
        pooling = state.params.pooling
        if end == len(state.token_ids) and pooling is not None:
            assert start == 0, "a pooling prompt is scheduled whole, in one step"
            self.pool_jobs.append(PoolJob(state.req_id, self.row, end, state.token_ids, pooling))
        elif end == len(state.token_ids):
            self.sample_rows.append(self.row + end - start - 1)
            self.sampled_req_ids.append(state.req_id)

    def add_prompt_job(self, state: RequestState, start: int, end: int) -> None:
        """The rows of this chunk whose next token is a prompt token, for a request asking prompt logprobs."""
        if state.prompt_logprobs_k is None or start >= state.num_prompt_tokens - 1:
            return
        last = min(end, state.num_prompt_tokens - 1)
        target_ids = state.token_ids[start + 1 : last + 1]
        self.prompt_jobs.append(
            PromptLogprobsJob(state.req_id, slice(self.row, self.row + last - start), target_ids,
                              state.prompt_logprobs_k, start)
        )

    def to_inputs(self, device: torch.device, long_rows_start: int) -> StepInputs:
        decode = None
        if self.decode_rows:
            decode = DecodeRows(
                self.block_size,
                np.asarray(self.decode_rows, dtype=np.int64),
                _stack_tables(self.decode_tables),
                np.asarray(self.decode_lens, dtype=np.int32),
            )
        positions = torch.tensor(self.positions, dtype=torch.int64, device=device)
        # every row in order (decode): no tensor to build, no hidden states to gather
        is_every_row = self.sample_rows == list(range(self.row))
        slots = torch.tensor(self.slots, dtype=torch.int64, device=device)
        return StepInputs(
            torch.tensor(self.input_ids, dtype=torch.int64, device=device),
            positions,
            _rope_rows(positions, self.long_rows, long_rows_start),
            AttentionMetadata(slots, self.seqs, decode, state_spans=self.state_spans),
            None if is_every_row else torch.tensor(self.sample_rows, dtype=torch.int64, device=device),
            self.sampled_req_ids,
            self.prompt_jobs,
            pool_jobs=self.pool_jobs,
        )


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
    next_attn = AttentionMetadata(plan.next_slots(positions), [], decode, plan, attn.state_spans)
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
