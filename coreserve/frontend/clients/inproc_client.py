"""InprocClient: the same EngineCore in this process, stepped by get_outputs, no sockets (frontend
process; debugging, and the in-process benchmarks). The one place the frontend holds a core: it imports
engine_core inside a function, so the frontend's modules still import only protocol.
"""

from __future__ import annotations

import gc
import os
import select

from coreserve.frontend.clients.client_protocol import add_spec_counts
from coreserve.protocol.config import EngineConfig
from coreserve.protocol.messages import (
    ControlCommand,
    ControlReply,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
)


class InprocClient:
    """The same EngineCore in this process, stepped by get_outputs; no sockets (debugging)."""

    def __init__(self, config: EngineConfig, fingerprint: str) -> None:
        from coreserve.engine_core.core import EngineCore

        self.core = EngineCore(config)
        if self.core.tokenizer_fingerprint != fingerprint:
            self.core.close()
            raise ValueError(
                "the engine core refused this frontend: its tokenizer does not match the model's"
            )
        self.facts = self.core.facts()
        self.client_id = b""
        self.pending: list[EngineCoreOutput] = []
        self.spec_counts: dict[str, list[int]] = {}

    def send(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            refusal = self.core.add_request(self.client_id, request)
            if refusal is not None:
                self.pending.append(refusal)

    def abort(self, req_ids: list[str]) -> None:
        self.core.abort_requests(self.client_id, req_ids)

    def get_stats(self) -> EngineStats:
        return self.core.stats()

    def control(self, command: ControlCommand) -> ControlReply:
        """The core runs the command, stepped here until it is done (an update in "wait" mode first lets
        the running requests finish; their outputs go to the next get_outputs)."""
        replies: list[ControlReply] = []

        def outbox(client: bytes, message: object) -> None:
            if isinstance(message, ControlReply):
                replies.append(message)
            elif isinstance(message, EngineCoreOutputs):
                self.pending.extend(self._outputs(message))

        self.core.control.submit(self.client_id, command, outbox)
        while not replies:
            for batch in self.core.step().values():
                self.pending.extend(self._outputs(batch))
            self.core.control.poll(outbox)
        self.core.publish_kv_events()
        return replies[0]

    def get_outputs(self, timeout_s: float, wake_fd: int | None = None) -> list[EngineCoreOutput]:
        outputs, self.pending = self.pending, []
        if not outputs and not self.core.has_unfinished_requests():
            if wake_fd is not None and select.select([wake_fd], [], [], timeout_s)[0]:
                os.read(wake_fd, 4096)
            return outputs
        for batch in self.core.step().values():
            outputs.extend(self._outputs(batch))
        return outputs

    def _outputs(self, message: EngineCoreOutputs) -> list[EngineCoreOutput]:
        add_spec_counts(self.spec_counts, message)
        return message.outputs

    def take_lost(self) -> dict[str, str]:
        return {}

    def take_spec_counts(self) -> dict[str, list[int]]:
        counts, self.spec_counts = self.spec_counts, {}
        return counts

    def shutdown(self) -> None:
        """Closes the core and gives its memory back now: the model's and KV cache's mappings are freed
        when their last reference goes, and some sit in reference cycles that only a collection frees
        (the user's process would otherwise hold every closed engine's memory until one ran)."""
        if self.core is not None:
            self.core.close()
        self.core = None
        gc.collect()
