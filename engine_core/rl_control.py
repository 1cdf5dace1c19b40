"""RL control of a running core (engine-core process): new weights in place, pause and resume, prefix
cache reset, sleep and wake (docs/rl.md has the rules a user sees).

Commands run between two steps, in the order they arrived, each answered by a ControlReply. One that
must wait for running requests (an update or a pause in "wait" mode, a sleep) holds admissions while
the running ones finish, and the commands after it wait their turn. Requests sent while the core is
paused or asleep wait in the queue; they run after resume / wake. `weight_version` counts updates;
every output carries the version whose weights computed it.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_core.scheduler import Scheduler
from protocol.messages import (
    ControlCommand,
    ControlReply,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    GetControlState,
    PauseGeneration,
    ResetPrefixCache,
    ResumeGeneration,
    Sleep,
    UpdateWeights,
    WakeUp,
)

if TYPE_CHECKING:  # the type only: torch comes with the executor, which core.py builds
    from worker.executor import Executor

logger = logging.getLogger(__name__)

Outbox = Callable[[bytes, object], None]  # (client, message): the server's output queue


class CoreControl:
    """Drives the executor's control verbs (worker/executor.py's Executor: the same in this process
    and across tensor-parallel ranks) between steps, and holds the scheduler meanwhile."""

    def __init__(self, scheduler: Scheduler, executor: Executor, reset_kv_pool: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.reset_kv_pool = reset_kv_pool  # a fresh block pool: every block free, nothing indexed
        self.weight_version = 0
        self.pause_mode: str | None = None  # the user's pause_generation, until resume_generation
        self.is_kv_asleep = False
        self.is_weights_asleep = False
        self.pending: list[tuple[bytes, ControlCommand]] = []
        self.timings: dict[str, float] | None = None  # the running command's phases, for its reply

    def submit(self, client: bytes, command: ControlCommand, outbox: Outbox) -> None:
        self.pending.append((client, command))
        self.poll(outbox)

    def poll(self, outbox: Outbox) -> None:
        """Runs the commands whose turn has come (called each turn of the core's loop)."""
        while self.pending:
            client, command = self.pending[0]
            if _drains(command) and self.scheduler.running and not self.scheduler.is_frozen:
                break  # running requests finish first; admissions are held meanwhile
            self.pending.pop(0)
            self.timings = None
            try:
                self._run(command, outbox)
            except Exception as exc:  # a ValueError refuses this command alone; anything else is fatal
                logger.warning("refused %s: %s", type(command).__name__, exc)
                outbox(client, self.reply(command.nonce, str(exc)))
                if not isinstance(exc, ValueError):
                    raise
                continue
            outbox(client, self.reply(command.nonce, timings=self.timings))
        self._apply_holds()

    def reply(
        self, nonce: int, error: str | None = None, timings: dict[str, float] | None = None
    ) -> ControlReply:
        level = 2 if self.is_weights_asleep else 1 if self.is_kv_asleep else 0
        return ControlReply(nonce, error, self.weight_version, self.pause_mode is not None, level, timings)

    def _apply_holds(self) -> None:
        is_asleep = self.is_kv_asleep or self.is_weights_asleep
        self.scheduler.is_frozen = self.pause_mode == "keep" or is_asleep
        draining = any(_drains(command) for _, command in self.pending)
        self.scheduler.can_admit = self.pause_mode is None and not is_asleep and not draining

    def _run(self, command: ControlCommand, outbox: Outbox) -> None:
        if isinstance(command, UpdateWeights):
            self._update(command, outbox)
        elif isinstance(command, PauseGeneration):
            if command.mode == "abort":
                self.abort_all(outbox)
            self.pause_mode = command.mode
        elif isinstance(command, ResumeGeneration):
            self.pause_mode = None
        elif isinstance(command, ResetPrefixCache):
            self.scheduler.kv_cache.reset_prefix_cache()
        elif isinstance(command, Sleep):
            self._sleep(command.level)
        elif isinstance(command, WakeUp):
            self._wake(command)
        else:
            assert isinstance(command, GetControlState)

    def _update(self, command: UpdateWeights, outbox: Outbox) -> None:
        """`timings`: the phases in this core (check: TP ranks' checks before any copies; load: checks
        and copies; derive: what depends on the weights' addresses; reset_prefix_cache), seconds."""
        begun = time.perf_counter()
        if command.check_only:  # several cores: each checks before any of them changes
            self.executor.check_weights(command.path)
            self.timings = {"check": time.perf_counter() - begun}
            return
        if command.mode == "abort":
            self.abort_all(outbox)
        phases = self.executor.update_weights(command.path)  # a ValueError leaves the old weights serving
        self.is_weights_asleep = False
        self.weight_version = self.weight_version + 1 if command.weight_version is None else command.weight_version
        self.abort_all(outbox, only_pinned=True)  # a request pinned to the old weights never sees new ones
        loaded = time.perf_counter()
        self.scheduler.kv_cache.reset_prefix_cache()
        done = time.perf_counter()
        self.timings = {
            **phases,
            "reset_prefix_cache": done - loaded,
            "core": done - begun,
        }
        logger.info("weights version %d in %.3f s", self.weight_version, done - begun)

    def _sleep(self, level: int) -> None:
        self.scheduler.preempt_running()  # only frozen ones ("keep") are left: computed again on wake
        self.executor.sleep(level)
        self.reset_kv_pool()
        self.is_kv_asleep = True
        self.is_weights_asleep = self.is_weights_asleep or level >= 2

    def _wake(self, command: WakeUp) -> None:
        tags = command.tags or ["weights", "kv_cache"]
        if "weights" in tags and (self.is_weights_asleep or command.path is not None):
            if command.path is None:
                raise ValueError("sleep level 2 dropped the weights: wake_up needs a checkpoint path "
                                 "(or call update_weights with the whole state)")
            self.executor.update_weights(command.path)
            self.is_weights_asleep = False
            self.weight_version += 1
        if "kv_cache" in tags and self.is_kv_asleep:
            self.executor.wake_up(True, None)
            self.is_kv_asleep = False

    def abort_all(self, outbox: Outbox, only_pinned: bool = False) -> None:
        """Every request in flight finished as aborted, each client told; `only_pinned`: only those
        pinned to another weight_version than the engine's now, finished with an error saying so."""
        reqs = list(self.scheduler.requests.values())
        if only_pinned:
            reqs = [r for r in reqs if r.params.weight_version not in (None, self.weight_version)]
        self.scheduler.abort_requests([r.req_id for r in reqs])
        by_client: dict[bytes, list[EngineCoreOutput]] = defaultdict(list)
        for req in reqs:
            output = EngineCoreOutput(req.client_req_id, [], finish_reason=FinishReason.ABORT)
            if only_pinned:
                output.finish_reason = FinishReason.ERROR
                output.error = pinned_error(req.params.weight_version, self.weight_version)
            output.weight_version = self.weight_version
            by_client[req.client_id].append(output)
        for client, outputs in by_client.items():
            outbox(client, EngineCoreOutputs(outputs, time.time()))


def pinned_error(pinned: int, held: int) -> str:
    return f"weight_version: the request is pinned to weights {pinned}, the engine holds {held}"


def _drains(command: ControlCommand) -> bool:
    """Whether the command waits for running requests to finish first."""
    if isinstance(command, UpdateWeights):
        return command.mode == "wait" and not command.check_only
    if isinstance(command, PauseGeneration):
        return command.mode == "wait"
    return isinstance(command, Sleep)
