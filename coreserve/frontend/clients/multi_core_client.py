"""Several engine cores behind one frontend (data parallel; frontend process): each request goes to
the core with the fewest requests in flight, the n completions of one prompt to one core, an abort to
the core that has the request. A core that dies fails only its own requests (EngineDeadError); new
requests go to the others, and engine stats are the sum over the cores that live.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict

import msgspec

from coreserve.frontend.clients.core_client import POLL_MS, MPClient, wait_for_outputs
from coreserve.frontend.clients.multi_core_control import control_every_core
from coreserve.frontend.errors import EngineDeadError
from coreserve.frontend.request_ids import parent_of
from coreserve.protocol.messages import (
    ControlCommand,
    ControlReply,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
    HandshakeReply,
)

logger = logging.getLogger(__name__)

_SAME_MODEL_FACTS = ("vocab_size", "max_model_len", "max_logprobs", "eos_token_ids", "block_size")


class MultiCoreClient:
    def __init__(self, cores: list[MPClient]) -> None:
        self.cores = cores
        self.live = list(cores)
        self.owner: dict[str, MPClient] = {}  # core request id -> its core
        self.num_in_flight: dict[MPClient, int] = dict.fromkeys(cores, 0)
        self.lost: dict[str, str] = {}  # core request id -> why (its core died)
        self.facts = _common_facts(cores)

    def send(self, requests: list[EngineCoreRequest]) -> None:
        """Groups the n completions of a prompt (coreserve/frontend/request_ids.py) and gives each group to the
        core with the fewest requests in flight."""
        if not self.live:
            raise EngineDeadError("every engine core is gone")
        groups: dict[str, list[EngineCoreRequest]] = defaultdict(list)
        for request in requests:
            groups[parent_of(request.req_id)].append(request)
        batches: dict[MPClient, list[EngineCoreRequest]] = defaultdict(list)
        for group in groups.values():
            core = min(self.live, key=self.num_in_flight.__getitem__)
            batches[core].extend(group)
            self.num_in_flight[core] += len(group)
            self.owner.update((r.req_id, core) for r in group)
        for core, batch in batches.items():
            self._guarded(core, core.send, batch)

    def abort(self, req_ids: list[str]) -> None:
        by_core: dict[MPClient, list[str]] = defaultdict(list)
        for req_id in req_ids:
            core = self.owner.pop(req_id, None)
            if core is not None:
                self.num_in_flight[core] -= 1
                by_core[core].append(req_id)
        for core, ids in by_core.items():
            if core in self.live:
                self._guarded(core, core.abort, ids)

    def get_outputs(self, timeout_s: float, wake_fd: int | None = None) -> list[EngineCoreOutput]:
        outputs = [o for core in self.live for o in core.take_pending()]
        deadline = time.monotonic() + timeout_s
        while not outputs:
            for core in list(self.live):
                self._guarded(core, core.tick)
            if not self.live:
                raise EngineDeadError("every engine core is gone")
            wait_ms = min(POLL_MS, max(0, int((deadline - time.monotonic()) * 1000)))
            is_woken = wait_for_outputs(self.live, wait_ms, wake_fd)
            for core in list(self.live):
                outputs.extend(core.take_pending() + (self._guarded(core, core.drain) or []))
            if is_woken or time.monotonic() >= deadline:
                break
        for output in outputs:
            if output.finish_reason is not None and output.req_id in self.owner:
                self.num_in_flight[self.owner.pop(output.req_id)] -= 1
        return outputs

    def take_lost(self) -> dict[str, str]:
        lost, self.lost = self.lost, {}
        return lost

    def take_spec_counts(self) -> dict[str, list[int]]:
        counts: dict[str, list[int]] = {}
        for core in self.live:
            counts.update(core.take_spec_counts())  # request ids are the frontend's: one core each
        return counts

    def get_stats(self) -> EngineStats:
        stats = [s for s in (self._guarded(core, core.get_stats) for core in list(self.live)) if s]
        if not stats:
            raise EngineDeadError("every engine core is gone")
        counts = EngineStats.__struct_fields__[1:]  # every field but the nonce is a count (or a list of them)
        return EngineStats(nonce=0, **{f: _sum_counts([getattr(s, f) for s in stats]) for f in counts})

    def control(self, command: ControlCommand) -> ControlReply:
        """Every live core runs the command (one model's daemons serve alike): an update checked by all
        before any copies, the first refusal the reply (coreserve/frontend/clients/multi_core_control.py)."""
        if not self.live:
            raise EngineDeadError("every engine core is gone")
        return control_every_core(self.live, command)

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()

    def _guarded(self, core: MPClient, method, *args):
        """Calls a core's method; a dead core is dropped and its requests are reported lost."""
        try:
            return method(*args)
        except EngineDeadError as exc:
            self._lose(core, str(exc))
            return None

    def _lose(self, core: MPClient, reason: str) -> None:
        logger.error("engine core at %s is gone: %s", core.address, reason)
        self.live.remove(core)
        for req_id in [r for r, owner in self.owner.items() if owner is core]:
            del self.owner[req_id]
            self.lost[req_id] = f"the engine core at {core.address} died: {reason}"
        self.num_in_flight[core] = 0
        core.shutdown()


def _common_facts(cores: list[MPClient]) -> HandshakeReply:
    """The cores must hold the same model; a request must fit the smallest KV cache."""
    first = cores[0].facts
    for core in cores[1:]:
        differ = [f for f in _SAME_MODEL_FACTS if getattr(core.facts, f) != getattr(first, f)]
        if differ:
            for c in cores:
                c.shutdown()
            raise ValueError(
                f"the engine cores at {cores[0].address} and {core.address} differ in {differ}: "
                "every core behind one frontend must hold the same model with the same limits"
            )
    return msgspec.structs.replace(first, num_kv_blocks=min(c.facts.num_kv_blocks for c in cores))


def _sum_counts(values: list) -> int | list[int]:
    """Counts summed across cores; lists of counts (per speculative position) summed element-wise."""
    if values and isinstance(values[0], list):
        return [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
    return sum(values)
