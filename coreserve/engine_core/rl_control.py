"""RL control of a running core (engine-core process): new weights in place, pause and resume, prefix
cache reset, sleep and wake (docs/rl.md has the rules a user sees).

`VERBS`, at the bottom, is the table of the verbs a client may call (a ControlCall names one; the
UpdateWeights and GetControlState messages are "update_weights" and "control_state"): each verb's
arguments, checked on arrival, what it does here between two steps, and whether it waits for the
running requests first. What reaches the model goes through the executor's `collective_rpc`, the same
in this process and across tensor-parallel ranks.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from coreserve.engine_core.scheduler import Scheduler
from coreserve.protocol.messages import (
    ControlCommand,
    ControlReply,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    GetControlState,
    PauseMode,
    UpdateWeights,
)

if TYPE_CHECKING:  # the type only: torch comes with the executor, which core.py builds
    from coreserve.worker.executor import Executor

logger = logging.getLogger(__name__)

Outbox = Callable[[bytes, object], None]  # (client, message): the server's output queue


class Args(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A verb's keyword arguments; a call whose arguments do not fit is refused, saying which."""


class NoArgs(Args):
    pass


class UpdateArgs(Args):
    path: str  # a safetensors file (in /dev/shm, or any local file) or a checkpoint folder
    mode: PauseMode = "wait"  # what happens to running requests before the weights change
    check_only: bool = False  # validate every name and shape, copy nothing (several cores: all check first)
    weight_version: int | None = None  # the version the new weights take (a trainer's step); None: + 1


class PauseArgs(Args):
    mode: PauseMode = "abort"


class SleepArgs(Args):
    level: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1  # 1: free the KV cache; 2: the weights too


class WakeArgs(Args):
    tags: list[Literal["weights", "kv_cache"]] | None = None  # None: both
    path: str | None = None  # after sleep level 2: the checkpoint the weights come back from


class LoadLoraArgs(Args):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # a new load of the adapter under this name (requests running keep theirs)
    lora_int_id: int | None = None  # the id its requests name (LoRARequest's); None: one the core gives


class LoraNameArgs(Args):
    lora_name: str


@dataclass(frozen=True)
class Call:
    """A command that arrived, its arguments checked, waiting its turn."""

    client: bytes
    nonce: int
    verb: str
    args: Args


class CoreControl:
    """Runs the verbs of VERBS between steps, and holds the scheduler meanwhile."""

    def __init__(self, scheduler: Scheduler, executor: Executor, reset_kv_pool: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.reset_kv_pool = reset_kv_pool  # a fresh block pool: every block free, nothing indexed
        self.weight_version = 0
        self.pause_mode: str | None = None  # the user's pause_generation, until resume_generation
        self.is_kv_asleep = False
        self.is_weights_asleep = False
        self.pending: list[Call] = []
        self.timings: dict[str, float] | None = None  # the running command's phases, for its reply
        self.loras = None  # the core's LoraTable (coreserve/engine_core/lora_table.py), set by the core

    def submit(self, client: bytes, command: ControlCommand, outbox: Outbox) -> None:
        """Queues the command; one whose verb or arguments do not fit is refused at once (nothing ran)."""
        try:
            call = Call(client, command.nonce, *parse(command))
        except ValueError as exc:
            outbox(client, self.reply(command.nonce, str(exc)))
            return
        self.pending.append(call)
        self.poll(outbox)

    def poll(self, outbox: Outbox) -> None:
        """Runs the commands whose turn has come (called each turn of the core's loop)."""
        while self.pending:
            call = self.pending[0]
            if _drains(call) and self.scheduler.running and not self.scheduler.is_frozen:
                break  # running requests finish first; admissions are held meanwhile
            self.pending.pop(0)
            self.timings = None
            try:
                result = VERBS[call.verb].run(self, call.args, outbox)
            except Exception as exc:  # a ValueError refuses this command alone; anything else is fatal
                logger.warning("refused %s: %s", call.verb, exc)
                outbox(call.client, self.reply(call.nonce, str(exc)))
                if not isinstance(exc, ValueError):
                    raise
                continue
            outbox(call.client, self.reply(call.nonce, timings=self.timings, result=result))
        self._apply_holds()

    def reply(
        self, nonce: int, error: str | None = None, timings: dict[str, float] | None = None, result: Any = None
    ) -> ControlReply:
        level = 2 if self.is_weights_asleep else 1 if self.is_kv_asleep else 0
        return ControlReply(nonce, error, self.weight_version, self.pause_mode is not None, level, timings, result)

    def _apply_holds(self) -> None:
        is_asleep = self.is_kv_asleep or self.is_weights_asleep
        self.scheduler.is_frozen = self.pause_mode == "keep" or is_asleep
        draining = any(_drains(call) for call in self.pending)
        self.scheduler.can_admit = self.pause_mode is None and not is_asleep and not draining

    # ---- the verbs: (args, outbox) -> what the reply carries back ------------------------------------

    def update_weights(self, args: UpdateArgs, outbox: Outbox) -> None:
        """`timings`: the phases in this core (check: every rank's checks before any copies; load: checks
        and copies, the slowest rank's; derive: what depends on the weights' addresses;
        reset_prefix_cache), seconds."""
        begun = time.perf_counter()
        self.executor.collective_rpc("check_weights", {"path": args.path})  # a refusal changes nothing
        checked = time.perf_counter()
        if args.check_only:  # several cores: each checks before any of them changes
            self.timings = {"check": checked - begun}
            return
        if args.mode == "abort":
            self.abort_all(outbox)
        phases = self._copy_weights(args.path)
        self.weight_version = self.weight_version + 1 if args.weight_version is None else args.weight_version
        self.abort_all(outbox, only_pinned=True)  # a request pinned to the old weights never sees new ones
        loaded = time.perf_counter()
        self.scheduler.kv_cache.reset_prefix_cache()
        done = time.perf_counter()
        self.timings = {"check": checked - begun, **phases, "reset_prefix_cache": done - loaded, "core": done - begun}
        logger.info("weights version %d in %.3f s", self.weight_version, done - begun)

    def pause_generation(self, args: PauseArgs, outbox: Outbox) -> None:
        if args.mode == "abort":
            self.abort_all(outbox)
        self.pause_mode = args.mode

    def resume_generation(self, args: NoArgs, outbox: Outbox) -> None:
        self.pause_mode = None

    def reset_prefix_cache(self, args: NoArgs, outbox: Outbox) -> None:
        self.scheduler.kv_cache.reset_prefix_cache()

    def sleep(self, args: SleepArgs, outbox: Outbox) -> None:
        self.scheduler.preempt_running()  # only frozen ones ("keep") are left: computed again on wake
        self.executor.collective_rpc("sleep", {"level": args.level})
        self.reset_kv_pool()
        self.is_kv_asleep = True
        self.is_weights_asleep = self.is_weights_asleep or args.level >= 2

    def wake_up(self, args: WakeArgs, outbox: Outbox) -> None:
        tags = args.tags or ["weights", "kv_cache"]
        if "weights" in tags and (self.is_weights_asleep or args.path is not None):
            if args.path is None:
                raise ValueError("sleep level 2 dropped the weights: wake_up needs a checkpoint path "
                                 "(or call update_weights with the whole state)")
            self.executor.collective_rpc("check_weights", {"path": args.path})
            self._copy_weights(args.path)
            self.weight_version += 1
            if not self.is_kv_asleep:  # the KV kept was computed with the old weights
                self.scheduler.kv_cache.reset_prefix_cache()
        if "kv_cache" in tags and self.is_kv_asleep:
            self.executor.collective_rpc("wake_up", {"kv_cache": True, "path": None})
            self.is_kv_asleep = False

    def load_lora_adapter(self, args: LoadLoraArgs, outbox: Outbox) -> int:
        """vLLM's /v1/load_lora_adapter (coreserve/engine_core/lora_table.py); the adapter's lora_int_id. A load in
        place is new policy weights, as an update is: the weight version moves on."""
        slot = self.loras.load(args.lora_name, args.lora_path, args.load_inplace, args.lora_int_id)
        if slot.generation > 0:
            self.weight_version += 1
        return slot.int_id

    def unload_lora_adapter(self, args: LoraNameArgs, outbox: Outbox) -> None:
        self.loras.unload(args.lora_name)

    def list_lora_adapters(self, args: NoArgs, outbox: Outbox) -> list[list[str]]:
        """[name, path] of every adapter the core knows."""
        return [list(entry) for entry in self.loras.adapters()]

    def control_state(self, args: NoArgs, outbox: Outbox) -> None:
        """Nothing: every reply carries the state."""

    def _copy_weights(self, path: str) -> dict[str, float]:
        """New weights on every rank (each checked them already); the slowest rank's phases."""
        phases = self.executor.collective_rpc("update_weights", {"path": path})
        self.is_weights_asleep = False
        return {key: max(p[key] for p in phases) for key in phases[0]}

    def stamp(self, outputs: dict[bytes, EngineCoreOutputs]) -> dict[bytes, EngineCoreOutputs]:
        """A step's outputs, each marked with the weights that made it (the default, 0, stays off the wire)."""
        if self.weight_version:
            for batch in outputs.values():
                for output in batch.outputs:
                    output.weight_version = self.weight_version
        return outputs

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


@dataclass(frozen=True)
class Verb:
    args: type[Args]
    run: Callable[[CoreControl, Any, Outbox], object]  # a ValueError refuses the command, nothing changed
    drains: Callable[[Any], bool] = lambda args: False  # waits for the running requests to finish first


def on_runner(verb: str) -> Callable[[CoreControl, Args, Outbox], object]:
    """`run` for a verb that the runner alone does (a method in coreserve/worker/runner_control.py's RUNNER_VERBS
    of the same name): its arguments as they came, rank 0's result in the reply."""
    return lambda control, args, outbox: control.executor.collective_rpc(verb, msgspec.structs.asdict(args))[0]


# The verbs a client may call, and no others. A new one: a row here (with its Args), and for what
# reaches the model a method in coreserve/worker/runner_control.py (`on_runner("its name")`).
VERBS: dict[str, Verb] = {
    "update_weights": Verb(UpdateArgs, CoreControl.update_weights, lambda a: a.mode == "wait" and not a.check_only),
    "pause_generation": Verb(PauseArgs, CoreControl.pause_generation, lambda a: a.mode == "wait"),
    "resume_generation": Verb(NoArgs, CoreControl.resume_generation),
    "reset_prefix_cache": Verb(NoArgs, CoreControl.reset_prefix_cache),
    "sleep": Verb(SleepArgs, CoreControl.sleep, lambda a: True),
    "wake_up": Verb(WakeArgs, CoreControl.wake_up),
    "control_state": Verb(NoArgs, CoreControl.control_state),
    "load_lora_adapter": Verb(LoadLoraArgs, CoreControl.load_lora_adapter),
    "unload_lora_adapter": Verb(LoraNameArgs, CoreControl.unload_lora_adapter),
    "list_lora_adapters": Verb(NoArgs, CoreControl.list_lora_adapters),
}


def parse(command: ControlCommand) -> tuple[str, Args]:
    """The command's verb and its arguments checked against the verb's; a ValueError says what is wrong."""
    if isinstance(command, UpdateWeights):
        verb, kwargs = "update_weights", msgspec.structs.asdict(command)
        del kwargs["nonce"]
    elif isinstance(command, GetControlState):
        verb, kwargs = "control_state", {}
    else:
        verb, kwargs = command.verb, command.kwargs
    if verb not in VERBS:
        raise ValueError(f"unknown control verb {verb!r}; this engine core knows {sorted(VERBS)}")
    try:
        return verb, msgspec.convert(kwargs, VERBS[verb].args)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{verb}: {exc}") from exc


def _drains(call: Call) -> bool:
    return VERBS[call.verb].drains(call.args)
