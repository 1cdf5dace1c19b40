"""One HTTP request's engine requests, started and ended together (frontend process, HTTP server).

A completions request may carry several prompts; each is one `AsyncLLM.generate` stream (its n
completions inside). `start()` waits for every stream's first output, so that a request the engine
refuses is a 400 before any byte of the response is sent; `deltas()` merges the streams; `close()`
aborts whatever is unfinished (client gone, error, cancel) and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from coreserve.frontend.outputs import RequestOutput
from coreserve.frontend.server.common.limits import Admission
from coreserve.frontend.server.common.metrics import RequestTimer, ServerMetrics
from coreserve.protocol.sampling_params import LoraRef, SamplingParams


@dataclass
class PromptInput:
    text: str | None  # the prompt as the client wrote it (None: given as token ids)
    token_ids: list[int]


class Generation:
    def __init__(
        self,
        engine,
        request_id: str,
        prompts: list[PromptInput],
        params: SamplingParams,
        metrics: ServerMetrics,
        admission: Admission | None = None,
        lora: LoraRef | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.params = params if lora is None else msgspec.structs.replace(params, lora=lora)  # the "model" adapter
        self.metrics = metrics
        self.admission = admission
        self._admitted = 0  # sequences the admission holds for this generation until it closes
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._timers: list[RequestTimer] = []
        self._firsts: list[RequestOutput] = []
        self._tasks: list[asyncio.Task] = []
        self.num_cached_tokens = [0] * len(prompts)  # per prompt: its tokens read from the prefix cache

    def usage(self, num_completion_tokens: int, with_cached_tokens: bool = False) -> dict:
        """OpenAI's usage object; each prompt counts once, whatever n is. `prompt_tokens_details` as vLLM
        fills it: the cached tokens with --enable-prompt-tokens-details where any were, else null."""
        num_prompt, num_cached = sum(len(p.token_ids) for p in self.prompts), sum(self.num_cached_tokens)
        return {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached} if with_cached_tokens and num_cached else None,
        }

    async def start(self) -> None:
        """Submits every prompt; raises the engine's ValueError (after aborting the others) when one is
        refused; the admission's 503 (limits.py) before anything is submitted."""
        if self.admission is not None:
            sequences = len(self.prompts) * self.params.n
            self.admission.admit(sequences)
            self._admitted = sequences
        try:
            await self._submit()
        except BaseException:  # refused, or cancelled (a shutdown): nothing left held
            await self.close()
            raise

    async def _submit(self) -> None:
        for i, prompt in enumerate(self.prompts):
            self._streams.append(
                self.engine.generate(prompt.token_ids, self.params, f"{self.request_id}-{i}")
            )
            self._timers.append(self.metrics.timer(len(prompt.token_ids), self.params.n))
        firsts = await asyncio.gather(*(_first(s) for s in self._streams), return_exceptions=True)
        errors = [item for item in firsts if isinstance(item, BaseException)]
        if errors:
            raise errors[0]
        self._firsts = firsts

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) in arrival order; every stream's first delta first."""
        queue: asyncio.Queue = asyncio.Queue()
        for i, first in enumerate(self._firsts):
            self._account(i, first)
            yield i, first
            if not first.finished:
                self._tasks.append(asyncio.create_task(self._pump(i, queue)))
        num_open = len(self._tasks)
        while num_open:
            item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                self._account(*item)
                yield item

    async def close(self) -> None:
        if self._admitted:
            self.admission.release(self._admitted)
            self._admitted = 0
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()  # an unfinished stream aborts its request as it closes

    async def _pump(self, index: int, queue: asyncio.Queue) -> None:
        try:
            async for out in self._streams[index]:
                queue.put_nowait((index, out))
        except Exception as exc:  # the engine died: the consumer raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    def _account(self, index: int, out: RequestOutput) -> None:
        timer = self._timers[index]
        self.num_cached_tokens[index] = max(self.num_cached_tokens[index], out.num_cached_tokens or 0)
        timer.on_tokens(sum(len(c.token_ids) for c in out.outputs))
        if out.finished:
            timer.on_finish([c.finish_reason for c in out.outputs])


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await stream.__anext__()
