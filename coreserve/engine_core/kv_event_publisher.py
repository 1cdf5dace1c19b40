"""The prefix cache's events on their way out (engine-core process): each engine step's events as one
vLLM `KVEventBatch`, sent from a thread of its own (the schema and the frames:
coreserve/engine_core/kv_events.py).

The publisher never blocks a step: a batch takes its sequence number when the engine hands it over and
waits in a queue; when `max_queue_size` batches wait, the newest is dropped and counted, and its number
is a gap a subscriber sees (it may ask the replay socket for what it missed while that is buffered; a
dropped batch was never sent, so a subscriber that finds a gap replay cannot fill should drop that
engine's state). The first batch, number 0, clears everything: a subscriber that kept an engine's state
across a restart starts again from nothing. Both sockets, and their ZeroMQ context, belong to the
publisher's thread alone; should it die, the engine logs why once and goes on without events.

An engine that connects (to llm-d's indexer, which binds) does so with an XPUB, which a SUB takes for a
PUB: ZeroMQ drops what a publisher sends before a subscriber's subscription has reached it (the TCP
connection is made after `connect`, and a SUB that binds sends its subscription only once its own thread
next uses it), so until a subscription to its topic arrives the thread takes no batch off the queue (they
wait there, up to `max_queue_size`); then it sends them all, in order, batch 0 too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from coreserve.engine_core.kv_events import END_OF_REPLAY, AllBlocksCleared, KVEvent, KVEventBatch
from coreserve.protocol.config import KVEventsConfig

logger = logging.getLogger(__name__)

POLL_S = 0.05  # the publisher thread's longest wait for a batch, between looks at the replay socket


class KVEventPublisher:
    """vLLM's ZeroMQ publisher: a PUB socket bound at `endpoint` (or an XPUB connected there: KVEventsConfig)
    sends [topic, seq, batch]; a ROUTER bound at `replay_endpoint` (if given) sends the buffered batches from a
    sequence number on."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config, self.data_parallel_rank = config, data_parallel_rank
        self.num_dropped = 0  # batches dropped because max_queue_size were waiting
        self._next_seq = 0
        self._batches: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(maxsize=config.max_queue_size)
        self._ready, self._stop = threading.Event(), threading.Event()
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:  # a bad or taken endpoint fails the engine's start, naming it
            raise ValueError(f"kv_events_config: cannot open {self._failure}")
        self.publish([AllBlocksCleared()])

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch takes (every batch before it was sent or dropped)."""
        return self._next_seq

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        if not self._thread.is_alive():
            if self._failure is None:
                self._failure = "the publisher thread ended"
            if self.num_dropped == 0:
                logger.error("KV events: no longer sent (%s)", self._failure)
            self.num_dropped += 1
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._batches.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (max_queue_size waiting)", self.num_dropped)

    def close(self) -> None:
        """Sends what is queued (within a few seconds), then closes the sockets."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        context, config = zmq.Context(), self.config
        sockets = []
        try:
            endpoint, binds = config.publish_to
            pub = context.socket(zmq.PUB if binds else zmq.XPUB)  # an XPUB hears the subscription come
            sockets.append(pub)
            pub.setsockopt(zmq.SNDHWM, config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            if binds:
                pub.bind(endpoint)
            else:  # a subscriber (llm-d's indexer) binds it: the engines connect
                pub.connect(endpoint)
            replay = None
            if config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.setsockopt(zmq.SNDHWM, 0)  # a replay of every buffered batch is never cut short
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(config.replay_endpoint)
        except Exception as exc:  # noqa: BLE001 - any failure to open is the start's error, named
            self._failure = f"{exc} ({config.publish_to[0]}, replay {config.replay_endpoint})"
            self._close(context, sockets)
            return
        finally:
            self._ready.set()
        try:
            self._serve(pub, replay, subscribed=binds)
        except Exception as exc:  # noqa: BLE001 - logged; the engine goes on without events
            self._failure = f"the publisher thread failed: {exc!r}"
            logger.exception("KV events publisher failed")
        finally:
            self._close(context, sockets)

    def _serve(self, pub: zmq.Socket, replay: zmq.Socket | None, subscribed: bool) -> None:
        """Sends each batch as it comes and answers replay requests; on an XPUB (`subscribed` False), only
        from the first subscription to the topic on."""
        encoder, topic = msgspec.msgpack.Encoder(), self.config.topic.encode()
        buffered: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)  # (seq, payload), latest
        xpub = pub.socket_type == zmq.XPUB
        while True:
            if replay is not None:
                while replay.poll(0):
                    _answer_replay(replay, buffered)
            if xpub:  # read every time: unread subscriptions would pile up
                subscribed = _heard_subscription(pub, topic) or subscribed
            if not subscribed:  # batches wait in the queue: sent now, they would be dropped
                if self._stop.is_set():
                    return
                pub.poll(int(POLL_S * 1000))
                continue
            try:
                seq, batch = self._batches.get(timeout=POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            payload = encoder.encode(batch)
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            buffered.append((seq, payload))

    @staticmethod
    def _close(context: zmq.Context, sockets: list[zmq.Socket]) -> None:
        for socket in sockets:
            socket.close()
        context.term()


def _heard_subscription(xpub: zmq.Socket, topic: bytes) -> bool:
    """Reads the (un)subscriptions waiting on an XPUB socket; whether one subscribes (b"\\x01" + prefix) to a
    prefix of `topic`."""
    heard = False
    while xpub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        message = xpub.recv()
        heard = heard or (message[:1] == b"\x01" and topic.startswith(message[1:]))
    return heard


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
