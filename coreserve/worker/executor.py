"""The engine core's one interface to the model: an `Executor`, built from one frozen `RunnerSpec`
(engine-core process). The model in this process (`ModelRunner`) or split over tensor-parallel rank
processes (`coreserve/worker/parallel/executor.py`) answer alike, steps and control verbs both; the core never
asks which. This is the only module of `coreserve/worker/` the core imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from coreserve.protocol.pooling_params import PoolingFacts
from coreserve.protocol.step import ModelRunnerOutput, SchedulerOutput
from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.step.runner_spec import RunnerSpec

__all__ = ["Executor", "RunnerSpec", "make_executor"]


class Executor(Protocol):
    model_args: DecoderArgs  # the whole model's (a rank holds its share of the heads)
    pooling: PoolingFacts | None  # runner="pooling": what the model pools to; None: the engine generates

    def bytes_per_block(self) -> int: ...  # KV cache bytes a block takes (on each rank)
    def host_kv_bytes(self, num_blocks: int) -> int: ...  # host memory that many blocks take (0 on a GPU)
    # A hybrid model's state cache (coreserve/worker/kv_memory.py): a slot a running request, and the prefix
    # cache's snapshot slots
    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int = 0, num_snapshot_slots: int = 0) -> None: ...
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    def close(self) -> None: ...  # stops rank processes, if any; safe to call twice

    # Control, between steps (docs/rl.md): the runner's verb `verb` (coreserve/worker/runner_control.py's
    # RUNNER_VERBS) run on every rank with `kwargs`, vLLM's collective_rpc; each rank's result, in rank
    # order. A ValueError from every rank refuses the verb, the model serving as it was; a verb that
    # some ranks refused and others did stops the engine (the ranks would serve apart).
    def collective_rpc(self, verb: str, kwargs: dict) -> list: ...


def make_executor(spec: RunnerSpec, on_progress: Callable[[], None] | None = None) -> Executor:
    """The model in this process, or split over `tensor_parallel_size` rank processes. `on_progress`
    is called after each layer and each step of a multi-step window (the core's liveness)."""
    # Imported here: the runner's machinery (the loader, the backends, the kernels' build) and the
    # rank processes' (ZeroMQ to the ranks) load only for the kind of executor chosen.
    if spec.tensor_parallel_size == 1:
        from coreserve.worker.model_runner import ModelRunner

        return ModelRunner(spec, on_progress=on_progress)
    from coreserve.worker.parallel.executor import TensorParallelExecutor

    return TensorParallelExecutor(spec, on_progress=on_progress)
