"""The contracts between the scheduler and the worker: SchedulerOutput in, ModelRunnerOutput back (engine-core
process, and each tensor-parallel rank process, which gets them over coreserve/worker/parallel/messages.py).
Plain data and numpy arrays, no torch. They live here, not in either role, because the worker never imports
the core and the core enters the worker through coreserve/worker/executor.py alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coreserve.protocol.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent once when a request is first scheduled, or again in full when it resumes after preemption."""

    req_id: str
    token_ids: list[int]  # prompt, then any output tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs_k: int | None  # None: not asked, or already delivered before a preemption
    logprobs_k: int | None  # k to compute per sampled token; -1: whole vocabulary
    logprobs_mode: str  # "raw" or "processed", the engine default resolved
    eos_token_ids: list[int]  # masked while fewer than min_tokens were generated; empty with ignore_eos
    # LongRoPE: every position rotates with the long factors (the request held more tokens than the
    # switch when it was admitted); False: the short ones (coreserve/engine_core/scheduler.py)
    is_long_rope: bool = False
    lora_slot: int = -1  # the loaded LoRA adapter the request runs with (coreserve/engine_core/lora_table.py); -1: none
    # A hybrid model: the snapshot slot its recurrent state starts from, its cached prefix's last boundary
    # (coreserve/engine_core/state_snapshots.py); -1: from zeros
    state_snapshot: int = -1


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step's tokens


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens this step, in batch order
    finished_req_ids: set[str]  # finished or preempted since the last step: the worker drops them
    num_steps: int = 1  # > 1 only for decode-only batches (multi-step)
    grammar_req_ids: list[str] = field(default_factory=list)  # rows that sample under a grammar this step
    # [len(grammar_req_ids), ceil(V / 32)] int32 little-endian; bit j of word w set: token 32 w + j allowed
    grammar_bitmask: bytes = b""
    # Speculative decoding: req_id -> the most tokens the worker may propose and verify for it this step,
    # after its one scheduled token (its KV blocks and the token budget are held for all of them)
    spec_tokens: dict[str, int] = field(default_factory=dict)
    # The proposals the scheduler made itself (a grammar request's: cut where its grammar refuses one);
    # its grammar's bitmask has a row for each verified position (grammar_req_ids repeats its id)
    spec_drafts: dict[str, list[int]] = field(default_factory=dict)
    # A hybrid model: req_id -> the snapshot slot its recurrent state is copied into after this step (its
    # computed tokens end on a snapshot boundary: coreserve/engine_core/state_snapshots.py)
    state_snapshots: dict[str, int] = field(default_factory=dict)


@dataclass
class HostLogprobs:
    """Logprob rows on the host; row r belongs to the r-th entry of the owner's id list."""

    token_ids: np.ndarray  # [num_rows, k + 1] int32, column 0 = sampled (or prompt) token
    logprobs: np.ndarray  # [num_rows, k + 1] float32
    ranks: np.ndarray  # [num_rows] int32, 1-based rank of column 0
    candidate_ranks: np.ndarray | None = None  # [num_rows, C] int32: the last C columns are candidate ids


@dataclass
class ModelRunnerOutput:
    sampled_req_ids: list[str]  # requests that sampled this step (their last scheduled token was the last)
    # [num_sampled_reqs, num_steps] int32; with speculation a row's tokens end at its first -1 (each
    # request keeps its verified tokens: the agreeing drafts and the model's own next token)
    sampled_token_ids: np.ndarray
    logprob_req_ids: list[str] = field(default_factory=list)  # subset of sampled_req_ids that asked
    logprobs: list[HostLogprobs] = field(default_factory=list)  # one per step, rows follow logprob_req_ids
    prompt_logprobs: dict[str, HostLogprobs] = field(default_factory=dict)  # rows of this step's chunk
    # req_id -> the probability mass its grammar allowed under the model's own distribution, per token
    # (logprob rows only)
    constraint_masses: dict[str, list[float]] = field(default_factory=dict)  # one per sampled token
    num_draft_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens proposed and verified
    # return_routed_experts: req_id -> (first position, [rows, MoE layers, top_k] int16) per forward pass
    routed_experts: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    # return_sampling_mask: req_id -> each sampled row's support (int32 ids), in row order (a window's
    # steps, a verified request's rows: the scheduler keeps one per kept token)
    sampling_masks: dict[str, list[np.ndarray]] = field(default_factory=dict)
    # return_hidden_states: req_id -> (first position, [its HF indices, rows, hidden] float32) per forward
    # pass, the positions it asked for (a recompute's again: the scheduler sends each position once)
    hidden_states: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    # runner="pooling": req_id -> its pooled vector [size] float32, for each request whose whole prompt
    # this step computed (it samples nothing and is finished)
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
