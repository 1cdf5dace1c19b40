"""The messages between the engine core and its tensor-parallel worker processes, msgspec over a ZeroMQ
PAIR socket per worker on `ipc://` (engine-core process and worker processes). No pickle: each side
decodes a closed, typed union.

Core -> worker: AllocateKvCache, Execute (the SchedulerOutput, as the scheduler made it), Shutdown;
for control, RankCall (one of the runner's control verbs by name, coreserve/worker/runner_control.py's
RUNNER_VERBS: RL's new weights, sleep and wake, LoRA adapters read and dropped).
Worker -> core: Ready (after loading), Done (rank 0's carries the runner output; after a RankCall, the
verb's result), Progress (a long step still moves), Refused (a control verb's ValueError; the rank goes
on), Failed (the reason, before the worker exits).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from coreserve.protocol.arrays import LogprobsArrays, RoutedExperts, SamplingMaskArrays
from coreserve.protocol.step import HostLogprobs, ModelRunnerOutput, SchedulerOutput
from coreserve.worker.step.runner_spec import RunnerSpec


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a rank process is started with (its command line, as JSON)."""

    address: str  # the core's PAIR socket for this rank
    rank: int
    size: int
    store_path: str  # the FileStore through which the ranks meet
    runner: RunnerSpec
    num_threads: int  # torch threads in this rank


class AllocateKvCache(msgspec.Struct, tag=True):
    num_blocks: int


class Execute(msgspec.Struct, tag=True):
    scheduler_output: SchedulerOutput


class Shutdown(msgspec.Struct, tag=True):
    pass


class RankCall(msgspec.Struct, tag=True):
    """`runner.control.<verb>(**kwargs)` on each rank, for a verb of RUNNER_VERBS alone (vLLM's collective_rpc)."""

    verb: str
    kwargs: dict[str, Any]  # msgpack values: the verb's keyword arguments


class Refused(msgspec.Struct, tag=True):
    reason: str


class WireRunnerOutput(msgspec.Struct, array_like=True):
    sampled_req_ids: list[str]
    num_steps: int
    sampled_token_ids: bytes  # [len(sampled_req_ids), num_steps] int32 little-endian
    logprob_req_ids: list[str]
    logprobs: list[LogprobsArrays]  # one per step
    prompt_logprobs: dict[str, LogprobsArrays]
    constraint_masses: dict[str, list[float]] = {}  # req_id -> the masses its grammar allowed (logprob rows)
    num_draft_tokens: dict[str, int] = {}  # speculative decoding: req_id -> tokens proposed and verified
    routed_experts: dict[str, list[RoutedExperts]] = {}  # return_routed_experts: per forward pass
    sampling_masks: dict[str, SamplingMaskArrays] = {}  # return_sampling_mask: a support per sampled row


class Ready(msgspec.Struct, tag=True):
    bytes_per_block: int  # this rank's KV cache bytes per block


class Done(msgspec.Struct, tag=True):
    output: WireRunnerOutput | None = None  # rank 0's, after Execute
    result: Any = None  # after a RankCall: what the verb returned (update_weights: its phases, s)


class Progress(msgspec.Struct, tag=True):
    pass


class Failed(msgspec.Struct, tag=True):
    reason: str


ToWorker = AllocateKvCache | Execute | Shutdown | RankCall
ToCore = Ready | Done | Progress | Refused | Failed


def to_wire(output: ModelRunnerOutput) -> WireRunnerOutput:
    sampled = np.ascontiguousarray(output.sampled_token_ids, dtype="<i4")
    return WireRunnerOutput(
        sampled_req_ids=output.sampled_req_ids,
        num_steps=sampled.shape[1],
        sampled_token_ids=sampled.tobytes(),
        logprob_req_ids=output.logprob_req_ids,
        logprobs=[_arrays(rows) for rows in output.logprobs],
        prompt_logprobs={req_id: _arrays(rows) for req_id, rows in output.prompt_logprobs.items()},
        constraint_masses=output.constraint_masses,
        num_draft_tokens=output.num_draft_tokens,
        routed_experts={
            req_id: [RoutedExperts.from_numpy(first, rows) for first, rows in parts]
            for req_id, parts in output.routed_experts.items()
        },
        sampling_masks={req_id: SamplingMaskArrays.from_rows(rows) for req_id, rows in output.sampling_masks.items()},
    )


def from_wire(wire: WireRunnerOutput) -> ModelRunnerOutput:
    sampled = np.frombuffer(wire.sampled_token_ids, dtype="<i4").reshape(
        len(wire.sampled_req_ids), wire.num_steps
    )
    return ModelRunnerOutput(
        sampled_req_ids=wire.sampled_req_ids,
        sampled_token_ids=sampled.astype(np.int32),
        logprob_req_ids=wire.logprob_req_ids,
        logprobs=[_host(arrays) for arrays in wire.logprobs],
        prompt_logprobs={req_id: _host(arrays) for req_id, arrays in wire.prompt_logprobs.items()},
        constraint_masses=dict(wire.constraint_masses),
        num_draft_tokens=dict(wire.num_draft_tokens),
        routed_experts={
            req_id: [(part.first_position, part.to_numpy()) for part in parts]
            for req_id, parts in wire.routed_experts.items()
        },
        sampling_masks={req_id: arrays.rows() for req_id, arrays in wire.sampling_masks.items()},
    )


def _arrays(rows: HostLogprobs) -> LogprobsArrays:
    return LogprobsArrays.from_numpy(rows.token_ids, rows.logprobs, rows.ranks, rows.candidate_ranks)


def _host(arrays: LogprobsArrays) -> HostLogprobs:
    candidate_ranks = arrays.candidate_ranks_np()
    return HostLogprobs(
        arrays.token_ids_np().astype(np.int32),
        arrays.logprobs_np().astype(np.float32),
        arrays.ranks_np().astype(np.int32),
        None if candidate_ranks is None else candidate_ranks.astype(np.int32),
    )
