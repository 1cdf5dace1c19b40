"""FrontendEngine: the one engine `LLM` and `AsyncLLM` both drive (frontend process).

It owns the submit sequence (tokenize and check in the caller's thread, register with the output
processor, send the core requests in one frame), the output pump (take the core's outputs, process
them, abort what a stop string or a failure ended), aborts and the core's stats. It is not
thread-safe: `LLM` calls it from the user's thread, `AsyncLLM` from its engine thread only.

A new engine-wide operation (a control call to the core) is a method here that calls the
`CoreClient`; `LLM` calls it directly and `AsyncLLM` runs it on its engine thread (`EngineCall`).
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend.client_protocol import CoreClient
from frontend.engine_parts import EngineParts, build_engine_parts
from frontend.input_processor import InputProcessor, PromptType
from frontend.output_processor import OutputProcessor, ProcessedOutputs
from frontend.outputs import RequestOutput
from frontend.token_text import TokenTable
from protocol.config import EngineConfig
from protocol.messages import EngineCoreRequest, EngineStats, HandshakeReply
from protocol.model_facts import generation_defaults
from protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedRequest:
    """A request tokenized and checked, ready to register; `request_id` keys its outputs."""

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
        """Tokenizes (and truncates) the prompt and checks the request; a bad one is a ValueError."""
        text, token_ids = self.inputs.process(prompt, params)
        return PreparedRequest(request_id, text, token_ids, params)

    def register(
        self, requests: list[PreparedRequest], *, is_delta: bool = False, recheck: bool = False
    ) -> list[EngineCoreRequest]:
        """Registers each request with the output processor and returns the core requests of all its
        completions; `recheck`: check each again first (its params may have changed since `prepare`
        while the user's code ran). On any error nothing of these requests stays registered."""
        core_requests: list[EngineCoreRequest] = []
        try:
            for request in requests:
                if recheck:
                    self.inputs.validate(request.prompt_token_ids, request.params)
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
        processed = self.outputs.process(outputs, self.client.take_lost())
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

    def shutdown(self) -> None:
        self.client.shutdown()
        control = self.__dict__.get("_rl")  # frontend/rl_control.py's, where update_weights ran
        if control is not None:
            control.buffer.release()  # its shared-memory weights file
