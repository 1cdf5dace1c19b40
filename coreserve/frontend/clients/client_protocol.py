"""CoreClient: the one interface the frontend engine has to the engine core(s) (frontend process).

Three clients implement it: `MPClient` (coreserve/frontend/clients/core_client.py: one core over ZeroMQ, spawned or a
daemon), `InprocClient` (coreserve/frontend/clients/inproc_client.py: the core in this process, no sockets) and
`MultiCoreClient` (coreserve/frontend/clients/multi_core_client.py: several daemons, data parallel). None is
thread-safe; the frontend engine calls it from one thread. A new kind of call to the core is a method
here first, then in each client. `add_spec_counts` is the tally behind each client's `take_spec_counts`.
"""

from __future__ import annotations

from typing import Protocol

from coreserve.protocol.messages import (
    ControlCommand,
    ControlReply,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    HandshakeReply,
)


class CoreClient(Protocol):
    facts: HandshakeReply  # the core's answer to the handshake: the model's limits

    def send(self, requests: list[EngineCoreRequest]) -> None:
        """Queues requests in the core, in as few frames as the frame limit allows (one batch);
        raises EngineDeadError when the core is gone."""

    def abort(self, req_ids: list[str]) -> None:
        """Aborts core requests; ids the core no longer has are ignored."""

    def get_outputs(self, timeout_s: float, wake_fd: int | None = None) -> list[EngineCoreOutput]:
        """The outputs that arrived, waiting up to `timeout_s` or until `wake_fd` (a pipe) is readable;
        raises EngineDeadError when the core is gone."""

    def take_lost(self) -> dict[str, str]:
        """Core request ids lost with a core that died while others live on, and why; then forgotten."""

    def take_spec_counts(self) -> dict[str, list[int]]:
        """Speculative decoding since the last call: core request id -> [tokens proposed, kept]."""

    def get_stats(self) -> EngineStats:
        """The core's state after everything this client sent before, taken between two steps."""

    def control(self, command: ControlCommand) -> ControlReply:
        """Runs an RL control command (docs/rl.md: UpdateWeights, GetControlState or a ControlCall of
        any verb) in the core(s) and waits for its reply; outputs that arrive meanwhile go to the next
        get_outputs."""

    def shutdown(self) -> None:
        """Says goodbye, stops a spawned or in-process core and releases sockets; idempotent."""


def add_spec_counts(into: dict[str, list[int]], message: EngineCoreOutputs) -> None:
    """A client's running tally of a message's speculation counts (req_id -> [proposed, kept])."""
    for req_id, (proposed, kept) in (message.spec_counts or {}).items():
        tally = into.setdefault(req_id, [0, 0])
        tally[0] += proposed
        tally[1] += kept
