"""The control verbs (RL, docs/rl.md) as `LLM` and `AsyncLLM` offer them, vLLM's names (frontend
process): one line each, calling the FrontendEngine's verb of the same name, whose docstring says more.
`AsyncLLM` runs it on its engine thread. A new verb is one method in each class below.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from coreserve.protocol.messages import ControlReply

if TYPE_CHECKING:
    from coreserve.frontend.engine.engine import FrontendEngine

T = TypeVar("T")


class LLMControlVerbs:
    """`LLM`'s: each runs in the caller's thread."""

    engine: FrontendEngine

    def update_weights(
        self,
        weights: str | os.PathLike | Iterable,
        mode: str = "wait",
        keep_buffer: bool = True,
        weight_version: int | None = None,
    ) -> int:
        """New weights in place ((HF name, tensor) pairs or a checkpoint path); returns the new
        weight_version (`weight_version`: the one to take; None: one more)."""
        return self.engine.update_weights(weights, mode, keep_buffer, weight_version)

    def check_weights(self, path: str | os.PathLike) -> None:
        """update_weights' checks of a checkpoint, nothing copied: a ValueError where it would be refused."""
        self.engine.check_weights(path)

    def pause_generation(self, mode: str = "abort") -> None:
        """Nothing new is scheduled until resume_generation; mode "abort", "wait" or "keep"."""
        self.engine.pause_generation(mode)

    def resume_generation(self) -> None:
        """Scheduling goes on after pause_generation."""
        self.engine.resume_generation()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (after new weights, the old KV is stale)."""
        self.engine.reset_prefix_cache()

    def load_lora_adapter(
        self, lora_name: str, lora_path: str | os.PathLike, load_inplace: bool = False, lora_int_id: int | None = None
    ) -> int:
        """A PEFT adapter under `lora_name` (`load_inplace`: a new load of it); its lora_int_id, which a
        LoRARequest names."""
        return self.engine.load_lora_adapter(lora_name, str(lora_path), load_inplace, lora_int_id)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.engine.unload_lora_adapter(lora_name)

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 the weights too; requests sent meanwhile wait for wake_up."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None, path: str | os.PathLike | None = None) -> None:
        """`tags`: "weights", "kv_cache" (None: both); `path`: the checkpoint after sleep level 2."""
        self.engine.wake_up(tags, path)

    def is_sleeping(self) -> bool:
        return self.engine.control_state().sleep_level > 0

    def get_weight_version(self) -> int:
        return self.engine.control_state().weight_version


class AsyncLLMControlVerbs:
    """`AsyncLLM`'s: each awaits the verb run on the engine thread, between two output pumps."""

    engine: FrontendEngine
    _call: Callable[[Callable[[FrontendEngine], T]], Awaitable[T]]  # AsyncLLM's: on its engine thread

    async def update_weights(
        self,
        weights: str | os.PathLike | Iterable,
        mode: str = "wait",
        keep_buffer: bool = True,
        weight_version: int | None = None,
    ) -> int:
        """New weights in place ((HF name, tensor) pairs or a checkpoint path); returns the new
        weight_version (`weight_version`: the one to take; None: one more)."""
        return await self._call(lambda engine: engine.update_weights(weights, mode, keep_buffer, weight_version))

    async def check_weights(self, path: str | os.PathLike) -> None:
        """update_weights' checks of a checkpoint, nothing copied: a ValueError where it would be refused."""
        await self._call(lambda engine: engine.check_weights(path))

    async def pause_generation(self, mode: str = "abort") -> None:
        """Nothing new is scheduled until resume_generation; mode "abort", "wait" or "keep"."""
        await self._call(lambda engine: engine.pause_generation(mode))

    async def resume_generation(self) -> None:
        """Scheduling goes on after pause_generation."""
        await self._call(lambda engine: engine.resume_generation())

    async def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (after new weights, the old KV is stale)."""
        await self._call(lambda engine: engine.reset_prefix_cache())

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str | os.PathLike, load_inplace: bool = False, lora_int_id: int | None = None
    ) -> int:
        """A hub id is fetched on a thread of its own, so that the engine thread goes on pumping outputs."""
        folder = await asyncio.to_thread(self.engine.adapter_folder, str(lora_path))
        return await self._call(lambda e: e.load_lora_adapter(lora_name, folder, load_inplace, lora_int_id))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._call(lambda e: e.unload_lora_adapter(lora_name))

    async def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 the weights too; requests sent meanwhile wait for wake_up."""
        await self._call(lambda engine: engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None, path: str | os.PathLike | None = None) -> None:
        """`tags`: "weights", "kv_cache" (None: both); `path`: the checkpoint after sleep level 2."""
        await self._call(lambda engine: engine.wake_up(tags, path))

    async def control_state(self) -> ControlReply:
        """weight_version, is_paused and sleep_level (0 awake, 1 KV cache freed, 2 the weights too)."""
        return await self._call(lambda engine: engine.control_state())

    async def is_sleeping(self) -> bool:
        return (await self.control_state()).sleep_level > 0
