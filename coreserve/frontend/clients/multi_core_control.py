"""RL control commands to several engines (data parallel; frontend process): `update_all_or_none`, the
one policy that keeps one weight version across engines, and `control_every_core`, the several-daemon
frontend's use of it (Ray Serve's replicas are the other, coreserve/frontend/server/deploy/ray_serve.py).

Every core gets every command. An update is checked by every engine before any engine copies (the
command with `check_only`), so a name or shape that one engine refuses is refused for all and no engine
changes: the weight versions stay in step. An engine that refuses after all checks passed (its copy of
the file gone, say) leaves the engines on different weights; that is said in the reply's error, naming
which took the update. Versions that came apart (a core updated by another frontend, or restarted)
make an update's and a state query's reply an error listing them; other commands go on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

from coreserve.protocol.messages import ControlCommand, ControlReply, GetControlState, UpdateWeights

R = TypeVar("R")


@dataclass(frozen=True)
class AllOrNone(Generic[R]):
    """What `update_all_or_none` did. `applied` False: an engine refused the check and no engine changed;
    `replies`: each engine's, in engine order (the check's where not applied, else the update's);
    `refused`: the indices of those that refused."""

    applied: bool
    replies: Sequence[R]
    refused: list[int]

    @property
    def is_split(self) -> bool:
        """Every check passed, then some engines took the update and others refused it."""
        return self.applied and 0 < len(self.refused) < len(self.replies)


def update_all_or_none(
    check: Callable[[], Sequence[R]],
    apply: Callable[[], Sequence[R]],
    refusal: Callable[[R], str | None],
) -> AllOrNone[R]:
    """`check`: every engine checks the update, nothing copied (each engine's reply, in order); `apply`:
    every engine takes it; `refusal`: a reply's reason, None where it accepted. `apply` runs only when
    no engine refused the check."""
    replies = check()
    refused = [i for i, reply in enumerate(replies) if refusal(reply) is not None]
    if refused:
        return AllOrNone(False, replies, refused)
    replies = apply()
    return AllOrNone(True, replies, [i for i, reply in enumerate(replies) if refusal(reply) is not None])


def control_every_core(cores: list, command: ControlCommand) -> ControlReply:
    """`cores`: the live MPClients. The first refusal is the reply; an update checked on all first
    (`update_all_or_none`; one core's update is all or none by itself: it checks before it copies)."""
    if isinstance(command, UpdateWeights) and not command.check_only and len(cores) > 1:
        check = msgspec.structs.replace(command, check_only=True)
        outcome = update_all_or_none(
            lambda: [core.control(check) for core in cores],
            lambda: [core.control(command) for core in cores],
            lambda reply: reply.error,
        )
        replies = list(outcome.replies)
        if outcome.is_split:
            took = [cores[i].address for i in range(len(cores)) if i not in outcome.refused]
            first = replies[outcome.refused[0]]
            error = (
                f"update_weights passed every core's checks, then the cores at {took} took it and "
                f"{[cores[i].address for i in outcome.refused]} refused it ({first.error}): "
                "they now serve different weights; update again"
            )
            return msgspec.structs.replace(first, error=error)
    else:
        replies = [core.control(command) for core in cores]
    refused = [i for i, r in enumerate(replies) if r.error is not None]
    if refused:
        return replies[refused[0]]
    versions = {core.address: r.weight_version for core, r in zip(cores, replies)}
    if len(set(versions.values())) > 1 and isinstance(command, UpdateWeights | GetControlState):
        applied = isinstance(command, UpdateWeights) and not command.check_only
        done = "the update was applied on every core, but " if applied else ""
        error = (
            f"{done}the engine cores' weight versions differ {versions}: one was updated or restarted "
            "apart from the others (each core counts its own updates; each output carries its core's)"
        )
        return msgspec.structs.replace(replies[0], error=error)
    return replies[0]
