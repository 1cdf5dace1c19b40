"""The proposer a runner builds from its spec's speculative config (engine-core process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from coreserve.worker.speculative.ngram import NgramProposer
from coreserve.worker.step.input_batch import RequestState
from coreserve.worker.step.runner_spec import RunnerSpec


class Proposer(Protocol):
    def propose(self, states: list[RequestState], most: list[int]) -> list[list[int]]: ...
    def forget(self, req_id: str) -> None: ...  # finished or preempted
    def kept(self, req_id: str, num_context: int, num_kept: int) -> None: ...  # after verification
    def host_kv_bytes(self, num_blocks: int) -> int: ...
    def allocate_kv_cache(self, num_blocks: int) -> None: ...
    def release(self) -> None: ...  # sleep: the KV cache goes


def make_proposer(spec: RunnerSpec, vocab_size: int, make_runner: Callable[[RunnerSpec], Any]) -> Proposer | None:
    """`make_runner` builds a draft model's runner (ModelRunner, which imports this module)."""
    config = spec.speculative
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(*config.lookup_range())
    from coreserve.worker.speculative.draft_model import DraftModelProposer

    return DraftModelProposer(spec, config, vocab_size, make_runner)
