"""The two wire contracts (EngineCoreRequest in, EngineCoreOutputs out) and the control messages.

Every message is a closed, tagged msgspec struct; a frame that decodes to anything else is rejected.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from coreserve.protocol.arrays import (
    HiddenStates,
    LogprobsArrays,
    PooledArray,
    RoutedExperts,
    SamplingMaskArrays,
)
from coreserve.protocol.pooling_params import PoolingFacts
from coreserve.protocol.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2
    ERROR = 3  # the request was refused or failed in the core; see EngineCoreOutput.error

    def __str__(self) -> str:
        return self.name.lower()


# ---- frontend -> core ---------------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", array_like=True):
    protocol_version: int
    tokenizer_fingerprint: str


class EngineCoreRequest(msgspec.Struct, array_like=True, gc=False):
    req_id: str  # unique within the sending client
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float


class AddRequests(msgspec.Struct, tag="add", array_like=True, gc=False):
    """Requests added together arrive together: the core schedules them as one batch. On the wire each
    is an EngineCoreRequest array inline; the core takes each as raw bytes and decodes it on its own,
    so that a malformed one is refused (with its id, when it has one) while the others are served."""

    requests: list[msgspec.Raw]

    @classmethod
    def of(cls, requests: list[EngineCoreRequest], encoder: msgspec.msgpack.Encoder) -> AddRequests:
        return cls([msgspec.Raw(encoder.encode(r)) for r in requests])


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    req_ids: list[str]


class Heartbeat(msgspec.Struct, tag="beat", array_like=True):
    pass


class GetStats(msgspec.Struct, tag="getstats", array_like=True):
    """Asks for an EngineStats, answered by the core's busy loop after everything this client sent
    before it (its aborts included), between two steps."""

    nonce: int


class Goodbye(msgspec.Struct, tag="bye", array_like=True):
    """The client is leaving: abort whatever it still has in flight."""


# Control for RL (docs/rl.md): each is answered by one ControlReply with its nonce, after everything the
# client sent before it, once the command is done (an update in "wait" mode waits for running requests).
# ControlCall names any verb of the core's table (coreserve/engine_core/rl_control.py's VERBS); the update and the
# state query have messages of their own, being the two a client of several cores looks into
# (coreserve/frontend/clients/multi_core_control.py: an update checked on every core first, versions compared).
PauseMode = Literal["abort", "wait", "keep"]


class ControlCall(msgspec.Struct, tag="call", array_like=True):
    """`verb(**kwargs)` in the core, e.g. ("sleep", {"level": 1}); the core refuses a verb it does not
    know or arguments that do not fit the verb's (docs/protocol.md lists them)."""

    nonce: int
    verb: str
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)  # msgpack values only


class UpdateWeights(msgspec.Struct, tag="update", array_like=True):
    """Load new weights in place: `path` is a safetensors file (in /dev/shm, or any local file) or a
    checkpoint folder; HF tensor names, the whole state or a part of it."""

    nonce: int
    path: str
    mode: PauseMode = "wait"  # what happens to running requests before the weights change
    check_only: bool = False  # validate every name and shape, copy nothing (several cores: all check first)
    weight_version: int | None = None  # the version the new weights take (a trainer's step); None: + 1


class GetControlState(msgspec.Struct, tag="getstate", array_like=True):
    nonce: int


ControlCommand = UpdateWeights | GetControlState | ControlCall
ClientMessage = (
    Hello | AddRequests | AbortRequests | Heartbeat | GetStats | Goodbye | UpdateWeights | GetControlState | ControlCall
)


# ---- core -> frontend ---------------------------------------------------------------------------------


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsArrays | None = None  # one row per new token, trimmed to the request's k
    prompt_logprobs: LogprobsArrays | None = None  # rows for prompt tokens 1..P-1, sent once
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that finished the request
    error: str | None = None  # with FinishReason.ERROR: why the core refused the request
    num_cached_tokens: int = 0  # in the first output: prompt tokens read from the prefix cache
    weight_version: int = 0  # the core's weights that computed this output (0 = those it started with)
    # What a few requests asked beside their tokens, in one field so that an output that asked nothing
    # costs one byte for all of them (the 64 x 21 wire test's bound)
    extras: TokenExtras | None = None


class TokenExtras(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per new token of a request with a grammar that asked for logprobs: the probability the model's own
    distribution gave the tokens the grammar allowed (docs/structured_outputs.md); return_routed_experts:
    the positions computed since the last output (prompt ones in the first); return_sampling_mask: one
    support per new token; return_hidden_states: the asked positions' rows computed since the last output
    (a prompt chunk's come as soon as it is computed, in an output without tokens); a pooling request:
    its pooled vector, in its one output (finished, without tokens)."""

    constraint_masses: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    sampling_mask: SamplingMaskArrays | None = None
    hidden_states: HiddenStates | None = None
    pooled: PooledArray | None = None


class EngineCoreOutputs(msgspec.Struct, tag="out", array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0
    # Speculative decoding: req_id -> [tokens proposed, tokens kept] in this step's verified rounds
    # (one field a message, not one an output: a step's outputs stay as small as without speculation)
    spec_counts: dict[str, list[int]] | None = None


class HandshakeReply(msgspec.Struct, tag="ready", array_like=True):
    """The model's facts, so that the frontend can validate requests before they leave."""

    protocol_version: int
    error: str | None
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    has_rl_control: bool = False  # the core takes the control commands (an older core omits it)
    num_moe_layers: int = 0  # a mixture of experts' routed layers (return_routed_experts); 0: dense
    num_hidden_layers: int = 0  # the model's decoder layers, L: HF's output_hidden_states has L + 1
    hidden_size: int = 0  # the hidden states' width; 0: this core returns none (the refusal says why)
    hidden_states_refusal: str = ""  # why return_hidden_states is refused here ("": it is not)
    runner: str = "generate"  # "generate" or "pooling" (vLLM's runner): which requests the core serves
    pooling: PoolingFacts | None = None  # a pooling core's model: its tasks and output size


class EngineStats(msgspec.Struct, tag="stats", array_like=True):
    """The answer to GetStats: the core's state between two steps, engine-wide (every client's
    requests). At idle every KV block is free or the prefix cache's (DESIGN.md)."""

    nonce: int  # the GetStats it answers
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_preemptions: int  # since the core started
    num_cached_blocks: int = 0  # blocks the prefix cache indexes (held by requests or free)
    prefix_cache_queries: int = 0  # prompt tokens of requests that looked their prefix up, since start
    prefix_cache_hits: int = 0  # of those, tokens read from the cache
    num_prefill_tokens: int = 0  # prompt positions computed since start (cache hits are not)
    # Speculative decoding since start: rounds with a proposal, tokens proposed, tokens kept, and kept
    # per proposal position (vLLM's spec_decode counters); zero and empty without speculation
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    num_heap_releases: int = 0  # times a core process went idle after a step and gave its free C heap
    # back to the OS (coreserve/engine_core/server.py's release_heap), since start; 0 in process
    # LoRA: the adapters of the running and of the waiting requests, by name (vllm:lora_requests_info)
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    # A hybrid model's state cache (recurrent layers): its slots (the most requests that run at once) and
    # the bytes a running request's slot takes; 0 for a model of attention layers only
    num_state_slots: int = 0
    state_bytes_per_seq: int = 0
    num_state_snapshots: int = 0  # with prefix caching: the states kept at cached chains' boundaries


class ControlReply(msgspec.Struct, tag="done", array_like=True):
    """The answer to a control command: done (error None) or refused with the reason, and the core's
    state after it."""

    nonce: int
    error: str | None
    weight_version: int
    is_paused: bool
    sleep_level: int  # 0 awake; 1 KV cache freed; 2 the weights too
    timings: dict[str, float] | None = None  # an update's phases in the core, seconds (docs/rl.md)
    result: Any = None  # what the verb returned, for a verb that returns something (msgpack values)


class EngineError(msgspec.Struct, tag="fatal", array_like=True):
    """The core hit an error it cannot recover from; the frontend raises EngineDeadError."""

    message: str


CoreMessage = EngineCoreOutputs | HandshakeReply | Heartbeat | EngineStats | ControlReply | EngineError
