"""The runner's control verbs (engine-core process, and each tensor-parallel rank's process): new
weights in place, sleep and wake, and `collective_rpc`, by which the core calls them by name.

`RunnerControl` is a part of `ModelRunner` (coreserve/worker/model_runner.py), kept here so that the verbs and
the table of the names the core may call stand together: a new verb is a method here and a row of
`RUNNER_VERBS`, nothing else of `coreserve/worker/`. In process `collective_rpc` calls the verb on this runner;
across ranks `coreserve/worker/parallel/executor.py` sends it to every rank as one `RankCall` and each rank
calls `call_verb` (coreserve/worker/parallel/rank.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

logger = logging.getLogger(__name__)


class RunnerControl:
    """The control verbs of `ModelRunner`, which owns the fields they change (weights, kv_caches, ...)."""

    def collective_rpc(self, verb: str, kwargs: dict) -> list:
        """The in-process Executor's: the verb run on this runner, its result as the one rank's."""
        return [call_verb(self, verb, kwargs)]

    def check_weights(self, path: str) -> None:
        """update_weights' checks of every name and shape, nothing copied (a ValueError when one fails)."""
        self.weights.check(path)

    def update_weights(self, path: str) -> dict[str, float]:
        """New weights in place, every tensor checked before any is copied (a ValueError leaves the old
        ones serving); what the backend derived from their addresses rebuilt. Returns the phases (load:
        checks and copies; derive), seconds."""
        begun = time.perf_counter()
        self.last_step_at = time.monotonic()  # the huge-page collapse waits, as on a step
        count = self.weights.update(path, self.backend.renew_weight_memory)
        loaded = time.perf_counter()
        if self.kv_caches:
            self.backend.bind(self.model, self.kv_caches)
        timings = {"load": loaded - begun, "derive": time.perf_counter() - loaded}
        logger.info("update_weights: %d tensors in %.3f s", count, time.perf_counter() - begun)
        self.last_step_at = time.monotonic()
        return timings

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache (the core's block pool restarts empty on wake); level 2 drops the
        weights too, keeping their shapes."""
        self.backend.release()
        self.kv_caches = []
        if self.speculator is not None:
            self.speculator.proposer.release()
        if level >= 2 and not self.weights.is_dropped:
            self.weights.drop()

    def wake_up(self, kv_cache: bool, path: str | None) -> None:
        """`path`: the checkpoint the dropped weights come back from (required after level 2)."""
        if path is not None:
            self.update_weights(path)
        elif self.weights.is_dropped:
            raise ValueError(
                "the weights were dropped (sleep level 2): wake up with a checkpoint path, "
                "or call update_weights with the whole state"
            )
        if kv_cache and not self.kv_caches and self.num_kv_blocks:
            self.allocate_kv_cache(self.num_kv_blocks)  # zeroed; the backend binds to it again


class RunnerVerb(NamedTuple):
    method: Callable[..., object]  # called as method(runner, **kwargs); a ValueError refuses it
    changes_state: bool  # False: a refusal on some ranks and not others leaves the ranks alike


# The verbs the core may call by name (Executor.collective_rpc), and no others.
RUNNER_VERBS: dict[str, RunnerVerb] = {
    "check_weights": RunnerVerb(RunnerControl.check_weights, changes_state=False),
    "update_weights": RunnerVerb(RunnerControl.update_weights, changes_state=True),
    "sleep": RunnerVerb(RunnerControl.sleep, changes_state=True),
    "wake_up": RunnerVerb(RunnerControl.wake_up, changes_state=True),
}


def call_verb(runner: RunnerControl, verb: str, kwargs: dict) -> object:
    """`runner.<verb>(**kwargs)` for a verb of RUNNER_VERBS; any other name is a bug of the core's."""
    if verb not in RUNNER_VERBS:
        raise KeyError(f"{verb!r} is not a runner verb (coreserve/worker/runner_control.py's RUNNER_VERBS)")
    return RUNNER_VERBS[verb].method(runner, **kwargs)
