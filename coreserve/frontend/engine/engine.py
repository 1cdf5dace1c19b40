"""FrontendEngine: the one engine `LLM` and `AsyncLLM` both drive (frontend process).

It owns the submit sequence (tokenize and check in the caller's thread, register with the output
processor, send the core requests in one frame), the output pump (take the core's outputs, process
them, abort what a stop string or a failure ended), aborts and the core's stats. It is not
thread-safe: `LLM` calls it from the user's thread, `AsyncLLM` from its engine thread only.

The control verbs (RL, docs/rl.md: new weights, pause and resume, prefix-cache reset, sleep and wake)
are methods here: each checks its arguments (a ValueError before anything leaves) and runs one verb of
the core's table (coreserve/engine_core/rl_control.py's VERBS) through `call`; a refusal is a ValueError with the
core's reason. `LLM` and `AsyncLLM` offer them in one line each (coreserve/frontend/control_verbs.py). Tensors
cross to the core as one safetensors file in shared memory, named on the wire (weights_buffer.py).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from coreserve.frontend.clients.client_protocol import CoreClient
from coreserve.frontend.engine.engine_parts import EngineParts, build_engine_parts
from coreserve.frontend.engine.input_processor import InputProcessor, PromptType, cache_salt_of
from coreserve.frontend.engine.output_processor import OutputProcessor, ProcessedOutputs
from coreserve.frontend.engine.template_sandbox import TemplateSandbox
from coreserve.frontend.engine.token_text import TokenTable
from coreserve.frontend.engine.weights_buffer import WeightsBuffer
from coreserve.frontend.lora import adapter_folder
from coreserve.frontend.outputs import RequestOutput
from coreserve.frontend.request_ids import submission_id
from coreserve.protocol.config import EngineConfig
from coreserve.protocol.messages import (
    ControlCall,
    ControlCommand,
    ControlReply,
    EngineCoreRequest,
    EngineStats,
    GetControlState,
    HandshakeReply,
    UpdateWeights,
)
from coreserve.protocol.model_facts import generation_defaults
from coreserve.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedRequest:
    """A request tokenized and checked, ready to register; `request_id` is its submission id
    (coreserve/frontend/request_ids.py), which keys its outputs and its core requests."""

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
        self.templates: TemplateSandbox = parts.templates
        self._serials = itertools.count()  # submission ids: unique however often a request id is reused
        self._nonces = itertools.count(1)  # control commands'
        self.weights_buffer = WeightsBuffer()  # update_weights' tensors, kept between updates
        self.last_update_timings: dict[str, float] = {}  # update_weights' phases, seconds (docs/rl.md)
        self._adapter_folders: dict[str, str] = {}  # a LoRARequest's hub id -> the folder it was fetched to

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

    def call(self, verb: str, **kwargs) -> ControlReply:
        """Runs `verb(**kwargs)` of the core's table (coreserve/engine_core/rl_control.py's VERBS) in every core
        and returns the reply (the core's state after it); a refusal is a ValueError with the reason."""
        return self._control(ControlCall(next(self._nonces), verb, kwargs))

    def update_weights(
        self,
        weights: str | os.PathLike | Iterable,
        mode: str = "wait",
        keep_buffer: bool = True,
        weight_version: int | None = None,
    ) -> int:
        """New weights in place: (HF name, tensor) pairs (a trainer's `named_parameters()`, whole or in
        part) or a checkpoint (a safetensors file or folder). `mode` says what running requests do
        first: "wait" (finish on the old weights), "abort", or "keep" (go on with the new).
        `keep_buffer`: the tensors' shared-memory file stays for the next update (rewritten in place;
        it holds the update's size until shutdown) or is freed now.
        Returns the new weight_version (`weight_version`: the one to take, e.g. a trainer's step; None:
        one more); a name or shape mismatch is a ValueError, old weights kept. `last_update_timings`:
        its phases."""
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
                path = self.weights_buffer.write(weights)
            written = time.perf_counter()
            reply = self._control(UpdateWeights(next(self._nonces), path, mode, weight_version=weight_version))
            replied = time.perf_counter()
        finally:
            if not keep_buffer:
                self.weights_buffer.release()
        core = dict(reply.timings or {})  # the core's phases; "core": its whole part
        wire = max(0.0, replied - written - core.get("core", 0.0))  # the messages and the waits between
        self.last_update_timings = {
            "write": written - begun,
            "round trip": replied - written,
            "wire": wire,
            **core,
            "total": time.perf_counter() - begun,
        }
        return reply.weight_version

    def check_weights(self, path: str | os.PathLike) -> None:
        """update_weights' checks of a checkpoint (names, shapes) in every core, nothing copied and no
        wait for running requests: a ValueError as update_weights' where it would be refused."""
        path = os.fspath(path)
        if not os.path.exists(path) and not _has_remote_core(self.client):
            raise ValueError(f"update_weights: {path} does not exist")
        self._control(UpdateWeights(next(self._nonces), path, check_only=True))

    def pause_generation(self, mode: str = "abort") -> None:
        """Nothing new is scheduled until resume_generation; "abort" ends requests in flight, "wait"
        returns once they finished, "keep" freezes them where they are."""
        _check_mode(mode)
        self.call("pause_generation", mode=mode)

    def resume_generation(self) -> None:
        """Scheduling goes on after pause_generation."""
        self.call("resume_generation")

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (after new weights, the old KV is stale)."""
        self.call("reset_prefix_cache")

    def load_lora_adapter(
        self, lora_name: str, lora_path: str, load_inplace: bool = False, lora_int_id: int | None = None
    ) -> int:
        """A PEFT adapter loaded under `lora_name` (`load_inplace`: a new load of a loaded one, which
        requests take from now on; those running keep theirs); returns its lora_int_id (`lora_int_id`:
        the one to take; None: the core gives one). docs/lora.md."""
        folder = self.adapter_folder(str(lora_path))
        reply = self.call("load_lora_adapter", lora_name=lora_name, lora_path=folder,
                          load_inplace=load_inplace, lora_int_id=lora_int_id)
        return reply.result

    def adapter_folder(self, path: str) -> str:
        """The folder the core reads for `path`; a hub id fetched afresh (a load may take a newer revision)
        where lora_allowed_roots admit it (coreserve/frontend/lora.py). Thread-safe: AsyncLLM fetches (here
        and in `request_adapter_folder`) in worker threads, off both its event loop and its engine thread."""
        folder = adapter_folder(path, self.config.lora_allowed_roots)
        if folder != path:
            self._adapter_folders[path] = folder
        return folder

    def request_adapter_folder(self, path: str) -> str:
        """A LoRARequest's path as the core reads it: a hub id fetched once, since the core reads a
        lora_int_id's path only when it first meets it."""
        known = self._adapter_folders.get(path)
        return known if known is not None else self.adapter_folder(path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self.call("unload_lora_adapter", lora_name=lora_name)

    def list_lora_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of every adapter the core knows."""
        reply = self.call("list_lora_adapters")
        return [tuple(entry) for entry in reply.result]

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 the weights too; requests sent meanwhile wait for wake_up."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (the weights too), got {level!r}")
        self.call("sleep", level=level)

    def wake_up(self, tags: list[str] | None = None, path: str | os.PathLike | None = None) -> None:
        """`tags`: "weights", "kv_cache" (None: both); `path`: the checkpoint after sleep level 2."""
        if tags is not None and (not tags or any(t not in WAKE_TAGS for t in tags)):
            raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {tags!r}")
        self.call("wake_up", tags=tags, path=None if path is None else os.fspath(path))

    def control_state(self) -> ControlReply:
        """weight_version, is_paused and sleep_level (0 awake, 1 KV cache freed, 2 the weights too)."""
        return self._control(GetControlState(next(self._nonces)))

    def _control(self, command: ControlCommand) -> ControlReply:
        reply = self.client.control(command)
        if reply.error is not None:
            raise ValueError(reply.error)
        return reply

    def shutdown(self) -> None:
        self.templates.close()
        self.client.shutdown()
        self.weights_buffer.release()  # the shared-memory weights file, where an update wrote one


PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")


def _has_remote_core(client: CoreClient) -> bool:
    """Whether a core is a daemon at a tcp address off this machine's loopback."""
    from coreserve.protocol.addresses import is_loopback

    cores = getattr(client, "cores", [client])
    return any(getattr(c, "address", None) and not is_loopback(c.address) for c in cores)
