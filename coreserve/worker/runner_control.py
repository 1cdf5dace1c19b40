"""The runner's control verbs (engine-core process, and each tensor-parallel rank's process): new
weights in place, sleep and wake, a LoRA adapter read into a slot and dropped; and `RUNNER_VERBS`, the
table of the names by which the core calls them (`Executor.collective_rpc`).

`RunnerControl` is a part the runner (coreserve/worker/model_runner.py) owns, built over the parts it
changes: the weights (WeightStore), the KV cache memory (coreserve/worker/kv_memory.py), the adapters'
slots (coreserve/worker/lora/slots.py). A new verb is a method here and a row of `RUNNER_VERBS`, nothing
else of `coreserve/worker/`. In process `collective_rpc` calls the verb on this runner's part; across
ranks `coreserve/worker/parallel/executor.py` sends it to every rank as one `RankCall` and each rank calls
`call_verb` (coreserve/worker/parallel/rank.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # the types only: the core's TP executor reads RUNNER_VERBS without the runner's parts
    from coreserve.worker.kv_memory import KvMemory
    from coreserve.worker.lora.slots import AdapterSlots
    from coreserve.worker.models.decoder import DecoderModel
    from coreserve.worker.models.weight_store import WeightStore

logger = logging.getLogger(__name__)


class RunnerControl:
    """`renew_weight_memory`: the backend's, for weights given fresh memory (a wake from level 2);
    `mark_busy`: the runner's, called around an update so that what waits for a quiet moment (the
    huge-page collapse) waits as on a step."""

    def __init__(self, weights: WeightStore, kv: KvMemory, lora: AdapterSlots | None,
                 renew_weight_memory: Callable[[DecoderModel], None], mark_busy: Callable[[], None]) -> None:
        self.weights = weights
        self.kv = kv
        self.lora = lora  # None: enable_lora is off
        self.renew_weight_memory = renew_weight_memory
        self.mark_busy = mark_busy

    def check_weights(self, path: str) -> None:
        """update_weights' checks of every name and shape, nothing copied (a ValueError when one fails)."""
        self.weights.check(path)

    def update_weights(self, path: str) -> dict[str, float]:
        """New weights in place, every tensor checked before any is copied (a ValueError leaves the old
        ones serving); what the backend derived from their addresses rebuilt. Returns the phases (load:
        checks and copies; derive), seconds."""
        begun = time.perf_counter()
        self.mark_busy()
        count = self.weights.update(path, self.renew_weight_memory)
        loaded = time.perf_counter()
        self.kv.rebind()
        timings = {"load": loaded - begun, "derive": time.perf_counter() - loaded}
        logger.info("update_weights: %d tensors in %.3f s", count, time.perf_counter() - begun)
        self.mark_busy()
        return timings

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache (the core's block pool restarts empty on wake); level 2 drops the
        weights too, keeping their shapes."""
        self.kv.free()
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
        if kv_cache:
            self.kv.restore()  # zeroed; the backend binds to it again

    def add_lora(self, slot: int, name: str, path: str) -> int:
        """The PEFT adapter at `path` read into `slot` (this rank's shard of it); its size in bytes. A
        ValueError names what does not fit (coreserve/worker/lora/adapter.py)."""
        if self.lora is None:
            raise ValueError("LoRA is off in this engine (start it with enable_lora=True, --enable-lora)")
        return self.lora.add(slot, name, path)

    def remove_lora(self, slot: int) -> None:
        """`slot`'s adapter dropped (none there: nothing to do)."""
        if self.lora is not None:
            self.lora.remove(slot)


class RunnerVerb(NamedTuple):
    method: Callable[..., object]  # called as method(control, **kwargs) (a RunnerControl); a ValueError refuses it
    changes_state: bool  # False: a refusal on some ranks and not others leaves the ranks alike


# The verbs the core may call by name (Executor.collective_rpc), and no others.
RUNNER_VERBS: dict[str, RunnerVerb] = {
    "check_weights": RunnerVerb(RunnerControl.check_weights, changes_state=False),
    "update_weights": RunnerVerb(RunnerControl.update_weights, changes_state=True),
    "sleep": RunnerVerb(RunnerControl.sleep, changes_state=True),
    "wake_up": RunnerVerb(RunnerControl.wake_up, changes_state=True),
    # a slot that some ranks refused and others read is never run (the core takes the load as refused
    # and removes the slot on every rank), so a partial refusal leaves nothing that serves apart
    "add_lora": RunnerVerb(RunnerControl.add_lora, changes_state=False),
    "remove_lora": RunnerVerb(RunnerControl.remove_lora, changes_state=True),
}


def call_verb(control: RunnerControl, verb: str, kwargs: dict) -> object:
    """`control.<verb>(**kwargs)` for a verb of RUNNER_VERBS; any other name is a bug of the core's."""
    if verb not in RUNNER_VERBS:
        raise KeyError(f"{verb!r} is not a runner verb (coreserve/worker/runner_control.py's RUNNER_VERBS)")
    return RUNNER_VERBS[verb].method(control, **kwargs)
