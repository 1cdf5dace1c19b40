"""KV-cache events (frontend and engine-core processes, and any subscriber): vLLM's `--kv-events-config`
and the msgpack schema its subscribers read (llm-d's precise prefix scorer, routers, NVIDIA Dynamo).

A subscriber connects a SUB socket to `endpoint` (or binds it, for engines that connect) and receives, per engine step that stored, evicted or
cleared a prefix-cache block, three frames: the topic, a sequence number (8 bytes, big-endian) and a
msgpack `KVEventBatch`: `[ts, [event, ...], data_parallel_rank]`, each event an array whose first element
names it: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. A block's hash is this
engine's id of that block's content, which names the whole prefix up to it (engine_core/prefix_index.py):
never reused, so a removal names exactly one stored block; a subscriber that needs keys shared across
engines derives them from the token ids (llm-d does). A replay socket (`replay_endpoint`, ROUTER) answers a
DEALER's `[b"", start_seq (8 bytes, big-endian)]` with each buffered batch from that sequence number on as
`[b"", seq, payload]`, then `[b"", -1 (8 bytes, signed), b""]`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
MEDIUM = "GPU"  # vLLM's name for an engine's own KV tier (its block pool), whatever the device
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's KVEventsConfig names and rules: the PUB socket binds an endpoint with a wildcard host (`*`,
    `::`) or an ipc:// or inproc:// one, and connects to any other (llm-d's indexer binds, its engines
    connect to it). Unlike vLLM, no endpoint given binds loopback (DEFAULT_ENDPOINT), not every
    interface: give `tcp://*:5557` for vLLM's default."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str | None = None  # None: bind DEFAULT_ENDPOINT
    replay_endpoint: str | None = None  # the ROUTER socket answering replay requests; None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark, in messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before the newest are dropped
    topic: str = ""  # the first frame of every message (llm-d: "kv@<pod>@<model>")

    def __post_init__(self) -> None:
        if self.buffer_steps < 0 or not 0 <= self.hwm < 2**31 or self.max_queue_size < 1:
            raise ValueError("kv_events_config: buffer_steps must be >= 0, hwm in 0..2**31-1 (0: none), "
                             "max_queue_size >= 1")

    @property
    def is_publishing(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @property
    def publish_to(self) -> tuple[str, bool]:
        """(the PUB socket's endpoint, whether it binds there rather than connects)."""
        if self.endpoint is None:
            return DEFAULT_ENDPOINT, True
        endpoint = self.endpoint
        return endpoint, "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def parse_kv_events_config(value: object) -> KVEventsConfig | None:
    """`kv_events_config` as a user gives it (a dict, JSON text, or the struct), vLLM's names; an unknown
    name or a wrong type is a ValueError naming it."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, (str, bytes)):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"kv_events_config must be a dict (JSON object), got {type(value).__name__}")
    try:
        return msgspec.convert(value, KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad kv_events_config: {exc}") from exc


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache; on the wire an array whose first element is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks newly indexed, in chain order: block_hashes[i] holds token_ids[i * block_size:
    (i + 1) * block_size]; the first one follows `parent_block_hash` (None: it starts a prompt)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted: their content is gone (the block is written anew)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every indexed block forgotten (a prefix-cache reset: new weights, sleep)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events, in order."""

    ts: float  # seconds since the epoch when the batch was made
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
