"""The engine core's one interface to the model: an `Executor`, built from one frozen `RunnerSpec`
(engine-core process). The model in this process (`ModelRunner`) or split over tensor-parallel rank
processes (`worker/parallel/executor.py`) answer alike; the core never asks which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from protocol.step import ModelRunnerOutput, SchedulerOutput
from worker.models.config import LlamaArgs


class RunnerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What builds an executor (and each tensor-parallel rank's runner), taken from EngineConfig."""

    model: str
    dtype: str
    device: str
    block_size: int
    seed: int
    can_use_cpu_kernels: bool = True
    batch_invariant: bool = True  # EngineConfig's: one order of summation per row, whatever the batch
    tensor_parallel_size: int = 1
    num_threads: int | None = None  # torch threads in each rank process; None: shared out among them


class Executor(Protocol):
    model_args: LlamaArgs  # the whole model's (a rank holds its share of the heads)

    def bytes_per_block(self) -> int: ...  # KV cache bytes a block takes (on each rank)
    def allocate_kv_cache(self, num_blocks: int) -> None: ...
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    def close(self) -> None: ...  # stops rank processes, if any; safe to call twice


def make_executor(spec: RunnerSpec, on_progress: Callable[[], None] | None = None) -> Executor:
    """The model in this process, or split over `tensor_parallel_size` rank processes. `on_progress`
    is called after each layer and each step of a multi-step window (the core's liveness)."""
    if spec.tensor_parallel_size == 1:
        from worker.model_runner import ModelRunner  # the runner imports this module for RunnerSpec

        return ModelRunner(spec, on_progress=on_progress)
    from worker.parallel.executor import TensorParallelExecutor

    return TensorParallelExecutor(spec, on_progress=on_progress)
