"""RL control commands to several engine cores behind one frontend (data parallel; frontend process).

Every core gets every command. An update is checked by every core before any core copies (the
command with `check_only`), so a name or shape that one core refuses is refused for all and no core
changes: the cores' weight versions stay in step. A core that refuses after all checks passed (its
copy of the file gone, say) leaves the cores on different weights; that is said in the reply's error,
naming which cores took the update. Versions that came apart (a core updated by another frontend, or
restarted) make an update's and a state query's reply an error listing them; other commands go on.
"""

from __future__ import annotations

import msgspec

from protocol.messages import ControlCommand, ControlReply, GetControlState, UpdateWeights


def control_every_core(cores: list, command: ControlCommand) -> ControlReply:
    """`cores`: the live MPClients. The first refusal is the reply; an update checked on all first."""
    if isinstance(command, UpdateWeights) and not command.check_only and len(cores) > 1:
        check = msgspec.structs.replace(command, check_only=True)
        refusal = next((r for r in (core.control(check) for core in cores) if r.error is not None), None)
        if refusal is not None:
            return refusal
    replies = [core.control(command) for core in cores]
    refused = [i for i, r in enumerate(replies) if r.error is not None]
    if refused and isinstance(command, UpdateWeights) and len(refused) < len(cores):
        took = [cores[i].address for i in range(len(cores)) if i not in refused]
        error = (
            f"update_weights passed every core's checks, then the cores at {took} took it and "
            f"{[cores[i].address for i in refused]} refused it ({replies[refused[0]].error}): "
            "they now serve different weights; update again"
        )
        return msgspec.structs.replace(replies[refused[0]], error=error)
    if refused:
        return replies[refused[0]]
    versions = {core.address: r.weight_version for core, r in zip(cores, replies)}
    if len(set(versions.values())) > 1 and isinstance(command, UpdateWeights | GetControlState):
        done = "the update was applied on every core, but " if isinstance(command, UpdateWeights) else ""
        error = (
            f"{done}the engine cores' weight versions differ {versions}: one was updated or restarted "
            "apart from the others (each core counts its own updates; each output carries its core's)"
        )
        return msgspec.structs.replace(replies[0], error=error)
    return replies[0]
