"""FrontendEngine: the one engine `LLM` and `AsyncLLM` both drive (frontend process).

It owns the submit sequence (tokenize and check in the caller's thread, register with the output
processor, send the core requests in one frame), the output pump (take the core's outputs, process
them, abort what a stop string or a failure ended), aborts and the core's stats. It is not
thread-safe: `LLM` calls it from the user's thread, `AsyncLLM` from its engine thread only.

A new engine-wide operation (a control call to the core) is a method here that calls the
`CoreClient` (or the RL control, `rl_control.py`); `LLM` wraps it in one line, and `AsyncLLM` in one
line that runs it on its engine thread (`EngineCall`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from frontend.clients.client_protocol import CoreClient
from frontend.engine.engine_parts import EngineParts, build_engine_parts
from frontend.engine.input_processor import InputProcessor, PromptType, cache_salt_of
from frontend.engine.output_processor import OutputProcessor, ProcessedOutputs
from frontend.engine.request_ids import submission_id
from frontend.engine.rl_control import RLControl
from frontend.engine.token_text import TokenTable
from frontend.outputs import RequestOutput
from protocol.config import EngineConfig
from protocol.messages import ControlReply, EngineCoreRequest, EngineStats, HandshakeReply
from protocol.model_facts import generation_defaults
from protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedRequest:
    """A request tokenized and checked, ready to register; `request_id` is its submission id
    (frontend/engine/request_ids.py), which keys its outputs and its core requests."""

    request_id: str
    prompt: str | None  # the text given, None for token ids
    prompt_token_ids: list[int]
    params: SamplingParams


class FrontendEngine:
    """`FrontendEngine.build(model, multiprocess=..., core_address=..., engine_args=...)` spawns or
    attaches to the core(s) and loads the tokenizer; `FrontendEngine(parts)` wraps parts built already."""

    def __init__(self, parts: EngineParts) -> None:
        self.config: EngineConfig = parts.config
        self.tokenizer = parts.tokenizer
        self.client: CoreClient = parts.client
        self.inputs: InputProcessor = parts.inputs
        self.outputs: OutputProcessor = parts.outputs
        self.control = RLControl(self.client)  # its last_timings: the last update's phases (docs/rl.md)
        self._serials = itertools.count()  # submission ids: unique however often a request id is reused

    @classmethod
    def build(
        cls,
        model: str | None,
        *,
        multiprocess: bool,
        core_address: str | list[str] | None,
        engine_args: dict,
    ) -> FrontendEngine:
        parts = build_engine_parts(
            model, multiprocess=multiprocess, core_address=core_address, engine_args=engine_args
        )
        return cls(parts)

    @property
    def facts(self) -> HandshakeReply:
        """The core's facts with this client's own limits applied: what requests are checked against."""
        return self.inputs.facts

    @property
    def token_table(self) -> TokenTable:
        """Each token id's bytes and text, as outputs render them (read-only)."""
        return self.outputs.table

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults; vLLM's own where it says nothing."""
        return SamplingParams(**generation_defaults(self.config.model))

    # ---- submit --------------------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: PromptType, params: SamplingParams) -> PreparedRequest:
        """Tokenizes (and truncates) the prompt and checks the request, the frontend's one check (a
        bad one is a ValueError); gives it its submission id. The params' fields are copied as checked,
        so setting a field of the user's object afterwards changes nothing sent (a shallow copy: a list
        or dict changed in place is shared; the core checks its own rules again on arrival)."""
        salt = cache_salt_of(prompt)
        if salt is not None:  # the prompt's salt, checked with the rest
            params = msgspec.structs.replace(params, cache_salt=salt)
        text, token_ids = self.inputs.process(prompt, params)
        key = submission_id(request_id, next(self._serials))
        return PreparedRequest(key, text, token_ids, msgspec.structs.replace(params))

    def register(self, requests: list[PreparedRequest], *, is_delta: bool = False) -> list[EngineCoreRequest]:
        """Registers each request with the output processor and returns the core requests of all its
        completions. On any error nothing of these requests stays registered."""
        core_requests: list[EngineCoreRequest] = []
        try:
            for request in requests:
                children = self.outputs.add_request(
                    request.request_id,
                    request.prompt,
                    request.prompt_token_ids,
                    request.params,
                    is_delta=is_delta,
                )
                core_requests.extend(
                    self.inputs.make_request(core_id, request.prompt_token_ids, params)
                    for core_id, params in children
                )
        except BaseException:
            for request in requests:
                self.outputs.abort(request.request_id)
            raise
        return core_requests

    def send(self, core_requests: list[EngineCoreRequest]) -> None:
        """One frame (split only past the frame limit), so the core schedules them as one batch; raises
        EngineDeadError when the core is gone."""
        self.client.send(core_requests)

    def add_requests(self, requests: list[PreparedRequest], *, is_delta: bool = False) -> None:
        """`register` then `send`; a failed send leaves nothing registered either."""
        core_requests = self.register(requests, is_delta=is_delta)
        try:
            self.send(core_requests)
        except BaseException:
            for request in requests:
                self.outputs.abort(request.request_id)
            raise

    # ---- pump, abort, stats --------------------------------------------------------------------------

    def step(self, timeout_s: float, wake_fd: int | None = None) -> ProcessedOutputs:
        """Waits up to `timeout_s` (or until `wake_fd` is readable) for the core's outputs and processes
        them; raises EngineDeadError when the core is gone."""
        outputs = self.client.get_outputs(timeout_s, wake_fd)
        processed = self.outputs.process(outputs, self.client.take_lost(), self.client.take_spec_counts())
        self.client.abort(processed.to_abort)
        return processed

    def has_unfinished(self) -> bool:
        return self.outputs.has_unfinished()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends the request as aborted, here and in the core; its last output, None if it was done."""
        core_ids, last_output = self.outputs.abort(request_id)
        self.client.abort(core_ids)
        return last_output

    def get_stats(self) -> EngineStats:
        """The core's state after everything sent before, taken between two steps (engine-wide)."""
        return self.client.get_stats()

    # ---- control (RL; docs/rl.md) ------------------------------------------------------------------

    def update_weights(
        self,
        weights: str | os.PathLike | Iterable,
        mode: str = "wait",
        keep_buffer: bool = True,
        weight_version: int | None = None,
    ) -> int:
        """New weights in place: (HF name, tensor) pairs or a checkpoint path. `mode` says what running
        requests do first: "wait" (finish on the old weights), "abort", or "keep" (go on with the new).
        `keep_buffer`: the tensors' shared-memory file stays for the next update (rewritten in place;
        it holds the update's size until shutdown) or is freed now.
        Returns the new weight_version (`weight_version`: the one to take, e.g. a trainer's step; None:
        one more); a name or shape mismatch is a ValueError, old weights kept."""
        return self.control.update_weights(weights, mode, keep_buffer, weight_version)

    def pause_generation(self, mode: str = "abort") -> None:
        """Nothing new is scheduled until resume_generation; "abort" ends requests in flight, "wait"
        returns once they finished, "keep" freezes them where they are."""
        self.control.pause_generation(mode)

    def resume_generation(self) -> None:
        self.control.resume_generation()

    def reset_prefix_cache(self) -> None:
        self.control.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 the weights too; requests sent meanwhile wait for wake_up."""
        self.control.sleep(level)

    def wake_up(self, tags: list[str] | None = None, path: str | os.PathLike | None = None) -> None:
        """`tags`: "weights", "kv_cache" (None: both); `path`: the checkpoint after sleep level 2."""
        self.control.wake_up(tags, path)

    def control_state(self) -> ControlReply:
        """weight_version, is_paused and sleep_level (0 awake, 1 KV cache freed, 2 the weights too)."""
        return self.control.state()

    def shutdown(self) -> None:
        self.client.shutdown()
        self.control.buffer.release()  # the shared-memory weights file, where an update wrote one
