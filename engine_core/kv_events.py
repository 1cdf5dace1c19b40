"""The prefix cache's events on their way out (engine-core process): `KVEventLog` collects what the
KV block pool stores, evicts and clears as it happens; `KVEventPublisher` sends each step's events as
one vLLM `KVEventBatch` from a thread of its own (the schema and the sockets: protocol/kv_events.py).

The log mirrors the prefix index exactly: a block is announced when its content is first indexed (an
equal block indexed before is not: it stays private, as the index keeps it), removed when evicted,
and a reset clears everything. So a subscriber that applies the events in order holds the index's
contents, content id for content id. The publisher never blocks a step: a batch waits in a queue, and
when `max_queue_size` batches wait the newest is dropped and counted (a subscriber sees the gap in the
sequence numbers and may ask the replay socket for what it missed, while it is buffered).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from protocol.kv_events import (
    END_OF_REPLAY,
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventsConfig,
)

logger = logging.getLogger(__name__)

POLL_S = 0.05  # the publisher thread's longest wait for a batch, between looks at the replay socket


class KVEventLog:
    """Events since the last `take`, in the order the pool made them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []

    def stored(self, block_hashes: list[int], parent: int | None, token_ids: list[int],
               lora: tuple[int, str] | None = None) -> None:
        """Full blocks newly indexed in chain order after `parent` (None: a prompt's first block);
        `lora`: the adapter's (int id, name) whose KV they hold."""
        lora_id, lora_name = lora if lora is not None else (None, None)
        self._events.append(BlockStored(block_hashes=block_hashes, parent_block_hash=parent, token_ids=token_ids,
                                        block_size=self.block_size, lora_id=lora_id, medium=MEDIUM,
                                        lora_name=lora_name))

    def removed(self, block_hash: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # one event for evictions in a row
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


class KVEventPublisher:
    """vLLM's ZeroMQ publisher: a PUB socket at `endpoint` (bound or connected: KVEventsConfig) sends
    [topic, seq, batch]; a ROUTER bound at `replay_endpoint` (if given) sends the buffered batches from a
    sequence number on. Both sockets are made and used by the publisher's thread alone."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config, self.data_parallel_rank = config, data_parallel_rank
        self.num_dropped = 0  # batches dropped because max_queue_size were waiting
        self._batches: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._ready, self._failure = threading.Event(), None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:  # a bad or taken endpoint fails the engine's start, naming it
            raise ValueError(f"kv_events_config: cannot open {self._failure}")

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._batches.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (max_queue_size waiting)", self.num_dropped)

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        self._batches.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        context, config = zmq.Context.instance(), self.config
        pub, replay = context.socket(zmq.PUB), None
        try:
            pub.setsockopt(zmq.SNDHWM, config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            endpoint, binds = config.publish_to
            if binds:
                pub.bind(endpoint)
            else:  # a subscriber (llm-d's indexer) binds it: the engines connect
                pub.connect(endpoint)
            if config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._failure = f"{exc} ({config.publish_to[0]}, replay {config.replay_endpoint})"
            for socket in (pub, replay):
                if socket is not None:
                    socket.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(pub, replay)
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _serve(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        encoder, topic, seq = msgspec.msgpack.Encoder(), self.config.topic.encode(), 0
        buffered: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)  # (seq, payload), latest
        while True:
            if replay is not None:
                while replay.poll(0):
                    _answer_replay(replay, buffered)
            try:
                batch = self._batches.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            buffered.append((seq, payload))
            seq += 1


def _answer_replay(replay: zmq.Socket, buffered: deque[tuple[int, bytes]]) -> None:
    """[identity, b"", start seq] in; each buffered batch from start on, then the end marker, out. A
    malformed request is logged and dropped."""
    frames = replay.recv_multipart()
    if len(frames) != 3 or len(frames[2]) != 8:
        logger.warning("KV events: a replay request of %d frames ignored", len(frames))
        return
    client, start = frames[0], int.from_bytes(frames[2], "big")
    for seq, payload in buffered:
        if seq >= start:
            replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
    replay.send_multipart((client, b"", END_OF_REPLAY, b""))
