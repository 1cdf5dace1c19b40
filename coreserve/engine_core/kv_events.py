"""KV-cache events (engine-core process, which alone writes them; the frontend never reads them): the
msgpack schema that vLLM's subscribers read (llm-d's precise prefix scorer, routers, NVIDIA Dynamo);
the config, vLLM's `--kv-events-config`, is `KVEventsConfig` (coreserve/protocol/config.py).

A subscriber connects a SUB socket to `endpoint` (or binds it, for engines that connect) and receives,
per engine step that stored, evicted or cleared a prefix-cache block, three frames: the topic, a
sequence number (8 bytes, big-endian) and a msgpack `KVEventBatch`: `[ts, [event, ...],
data_parallel_rank]`, each event an array whose first element names it: `["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes,
medium]`, `["AllBlocksCleared"]`. A block's hash is this engine's id of that block's content, which
names the whole prefix up to it (coreserve/engine_core/prefix_index.py): never reused, so a removal names exactly
one stored block; a subscriber that needs keys shared across engines derives them from the token ids
(llm-d does). A replay socket (`replay_endpoint`, ROUTER) answers a DEALER's `[b"", start_seq (8 bytes,
big-endian)]` with each buffered batch from that sequence number on as `[b"", seq, payload]`, then
`[b"", -1 (8 bytes, signed), b""]`.
"""

from __future__ import annotations

import msgspec

MEDIUM = "GPU"  # vLLM's name for an engine's own KV tier (its block pool), whatever the device
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


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
