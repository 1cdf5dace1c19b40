"""What every handler of one server shares: the engine, the served name, the chat renderer, metrics
(frontend process, HTTP server). Built once by `launch` (or a test) and kept on `app.state.server`."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from coreserve.frontend.engine.chat_template import ChatRenderer
from coreserve.frontend.engine.token_text import TokenTable
from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.common.limits import DEFAULT_MAX_REQUEST_BYTES, Admission, PromptBound
from coreserve.frontend.server.common.metrics import ServerMetrics
from coreserve.frontend.server.deploy.drain import Drain
from coreserve.protocol.sampling_params import LoraRef


@dataclass
class ServerState:
    engine: object  # AsyncLLM
    served_model_name: str
    chat_template: str | None = None
    api_key: str | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    table: TokenTable | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    started_at: int = field(default_factory=lambda: int(time.time()))
    prompt_bound: PromptBound | None = None
    enable_rl_endpoints: bool = False  # /update_weights_from_disk, /pause, /sleep, ... (rl/control.py)
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details filled (else null, as vLLM)
    max_queued_requests: int | None = None  # past max_num_seqs + this many sequences: 503 (common/limits.py)
    admission: Admission | None = None
    _serials: itertools.count = field(default_factory=itertools.count)
    live: dict = field(default_factory=dict)  # SGLang /generate requests running, by rid (/abort_request)
    enable_lora: bool = False  # --enable-lora: adapters by name, and the load/unload routes (lora.py)
    loras: dict[str, LoraRef] = field(default_factory=dict)  # the adapters a request's "model" may name
    enable_auto_tool_choice: bool = False  # tool_choice auto parsed by the tool_call_parser (tool_choice.py)
    tool_call_parser: str | None = None  # parsers/tool_calls.py TOOL_PARSERS
    reasoning_parser: str | None = None  # parsers/reasoning.py REASONING_PARSERS
    drain: Drain = field(default_factory=Drain)  # requests in flight; new ones refused once a stop began
    renderer: ChatRenderer = field(init=False)  # every chat route's (chat_template's, else the tokenizer's)

    def __post_init__(self) -> None:
        if self.table is None:  # the engine's own: built once per tokenizer (128k entries for Llama 3)
            self.table = self.engine.token_table
        if self.prompt_bound is None:
            self.prompt_bound = PromptBound(self.table, self.tokenizer)
        if self.admission is None:
            self.admission = Admission(self.engine.config.max_num_seqs, self.max_queued_requests)
        self.metrics.name(self.served_model_name, self.engine)
        self.renderer = ChatRenderer(self.tokenizer, self.engine.templates, self.chat_template)
        if self.renderer.template:
            self.engine.templates.start()  # the renderers import now, not on the first chat request

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def facts(self):
        """The core's HandshakeReply: vocab_size, max_model_len, max_logprobs, ..."""
        return self.engine.facts

    def check_model(self, name: str | None) -> LoraRef | None:
        """The adapter a request's `model` names (None: the base model); a 404 for a name not served."""
        if name is None or name == self.served_model_name:
            return None
        lora = self.loras.get(name)
        if lora is None:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return lora

    def answer_name(self, lora: LoraRef | None) -> str:
        """The `model` an answer names: the adapter's where the request named one (as vLLM answers)."""
        return self.served_model_name if lora is None else lora.name

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{self.started_at:x}{next(self._serials):06d}"
