"""RL control from the user's process (frontend): new weights, pause and resume, prefix-cache reset,
sleep and wake, as commands to the core (docs/rl.md). `FrontendEngine` owns one and its control verbs
call it; `LLM` and `AsyncLLM` call those.

Tensors cross the process boundary as one safetensors file in shared memory, named on the wire
(frontend/engine/weights_buffer.py: kept between updates and rewritten in place). No pickle. torch is
imported inside the writer only.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable

from frontend.engine.weights_buffer import WeightsBuffer
from protocol.messages import (
    ControlCommand,
    ControlReply,
    GetControlState,
    PauseGeneration,
    ResetPrefixCache,
    ResumeGeneration,
    Sleep,
    UpdateWeights,
    WakeUp,
)

PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")


class RLControl:
    """Builds each command with a fresh nonce and turns a refusal into a ValueError. `client`: a
    CoreClient (frontend/clients/client_protocol.py) with `control(command) -> ControlReply`."""

    def __init__(self, client) -> None:
        self.client = client
        self._nonces = itertools.count(1)
        self.last_timings: dict[str, float] = {}  # update_weights' breakdown, seconds (docs/rl.md)
        self.buffer = WeightsBuffer()

    def update_weights(
        self,
        weights: str | os.PathLike | Iterable,
        mode: str = "wait",
        keep_buffer: bool = True,
        weight_version: int | None = None,
    ) -> int:
        """`weights`: (HF name, tensor) pairs (a trainer's `named_parameters()`, whole or in part) or
        a checkpoint (a safetensors file or folder). Returns the new weight_version (`weight_version`:
        the one to take, a trainer's own numbering; None: one more). `keep_buffer`: keep the
        shared-memory file for the next update (rewritten in place, faster) or free it."""
        _check_mode(mode)
        if weight_version is not None and (
            not isinstance(weight_version, int) or isinstance(weight_version, bool) or weight_version < 0
        ):
            raise ValueError(f"weight_version must be a non-negative integer, got {weight_version!r}")
        begun = time.perf_counter()
        is_path = isinstance(weights, (str, os.PathLike))
        if is_path:
            path = os.fspath(weights)
            if not os.path.exists(path) and not _has_remote_core(self.client):  # a remote one's own path
                raise ValueError(f"update_weights: {path} does not exist")
        written = replied = begun
        try:
            if not is_path:
                path = self.buffer.write(weights)
            written = time.perf_counter()
            reply = self._run(UpdateWeights(next(self._nonces), path, mode, weight_version=weight_version))
            replied = time.perf_counter()
        finally:
            if not keep_buffer:
                self.buffer.release()
        done = time.perf_counter()
        core = dict(reply.timings or {})  # the core's phases; "core": its whole part
        wire = max(0.0, replied - written - core.get("core", 0.0))  # the messages and the waits between
        self.last_timings = {
            "write": written - begun,
            "round trip": replied - written,
            "wire": wire,
            **core,
            "total": done - begun,
        }
        return reply.weight_version

    def pause_generation(self, mode: str = "abort") -> None:
        _check_mode(mode)
        self._run(PauseGeneration(next(self._nonces), mode))

    def resume_generation(self) -> None:
        self._run(ResumeGeneration(next(self._nonces)))

    def reset_prefix_cache(self) -> None:
        self._run(ResetPrefixCache(next(self._nonces)))

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(
                f"sleep level must be 1 (free the KV cache) or 2 (the weights too), got {level!r}"
            )
        self._run(Sleep(next(self._nonces), level))

    def wake_up(self, tags: list[str] | None = None, path: str | os.PathLike | None = None) -> None:
        if tags is not None and (not tags or any(t not in WAKE_TAGS for t in tags)):
            raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {tags!r}")
        self._run(WakeUp(next(self._nonces), tags, None if path is None else os.fspath(path)))

    def state(self) -> ControlReply:
        """weight_version, is_paused and sleep_level (0 awake, 1 KV cache freed, 2 the weights too)."""
        return self._run(GetControlState(next(self._nonces)))

    def _run(self, command: ControlCommand) -> ControlReply:
        reply = self.client.control(command)
        if reply.error is not None:
            raise ValueError(reply.error)
        return reply


def _has_remote_core(client) -> bool:
    """Whether a core is a daemon at a tcp address off this machine's loopback."""
    from protocol.addresses import is_loopback

    cores = getattr(client, "cores", [client])
    return any(getattr(c, "address", None) and not is_loopback(c.address) for c in cores)


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
