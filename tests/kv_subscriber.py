"""A subscriber of vLLM's KV-cache events as the routers that read them do (llm-d's indexer, a
kv_aware router), written from their published schema, for the tests: it applies each engine's events in
order (its cache contents: engine hash -> (parent hash, tokens)) and derives llm-d's block keys from the
token ids: FNV-1a 64 over canonical CBOR of [parent key, the block's tokens, null], the chain's root
FNV-1a 64 over CBOR of [FNV-1a 64 of the hash seed, null, the model's (or the adapter's) name].
"""

from __future__ import annotations

import time

import cbor2
import msgspec
import zmq

from coreserve.engine_core.kv_events import END_OF_REPLAY

FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def fnv1a_64(data: bytes) -> int:
    value = FNV_OFFSET
    for byte in data:
        value = ((value ^ byte) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return value


def llm_d_key(parent: int, tokens: list[int]) -> int:
    return fnv1a_64(cbor2.dumps([parent, list(tokens), None], canonical=True))


def llm_d_root(model: str, seed: str = "") -> int:
    return fnv1a_64(cbor2.dumps([fnv1a_64(seed.encode()), None, model], canonical=True))


class EngineView:
    """One engine's cache contents as its events tell them, and llm-d's keys of its blocks."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # engine hash -> (parent, tokens)
        self.keys: dict[int, int] = {}  # engine hash -> llm-d key
        self.lora_names: list[str | None] = []  # of every BlockStored, in order
        self.num_removed = 0  # blocks the engine said it evicted

    def apply(self, event: list) -> None:
        kind = event[0]
        if kind == "BlockStored":
            hashes, parent, tokens, block_size, _lora_id, medium, lora_name = event[1:8]
            assert medium == "GPU" and len(tokens) == block_size * len(hashes)
            self.lora_names.append(lora_name)
            key = self.keys[parent] if parent is not None else llm_d_root(lora_name or self.model)
            for i, block_hash in enumerate(hashes):
                chunk = tuple(tokens[i * block_size : (i + 1) * block_size])
                assert block_hash not in self.blocks, "a content announced twice"
                self.blocks[block_hash] = (parent, chunk)
                key = llm_d_key(key, list(chunk))
                self.keys[block_hash], parent = key, block_hash
        elif kind == "BlockRemoved":
            self.num_removed += len(event[1])
            for block_hash in event[1]:
                del self.blocks[block_hash]
                del self.keys[block_hash]
        else:
            assert kind == "AllBlocksCleared", event
            self.blocks.clear()
            self.keys.clear()

    def hit_blocks(self, token_ids: list[int], block_size: int = 16, lora_name: str | None = None) -> int:
        """llm-d's view of a prompt's cached prefix: its leading full blocks whose keys some block holds,
        of those the engine may read (never the last token: its logits are computed)."""
        held, key, count = set(self.keys.values()), llm_d_root(lora_name or self.model), 0
        for start in range(0, len(token_ids) - 1 - block_size + 1, block_size):
            key = llm_d_key(key, token_ids[start : start + block_size])
            if key not in held:
                break
            count += 1
        return count


class Subscriber:
    """SUB sockets on engines' endpoints (connected, or bound where the engines connect: `binds`, llm-d's
    indexer), their batches applied per topic in sequence order as they come; a gap in the numbers
    (batches sent before the subscription took hold) is filled from the engine's replay socket, as
    vllm-router's subscriber does, and must be filled, but for batch 0 alone (AllBlocksCleared: to a view
    that holds nothing yet, missing it changes nothing)."""

    def __init__(self, endpoints: dict[str, str], model: str, replays: dict[str, str] | None = None,
                 binds: bool = False) -> None:
        self.context = zmq.Context()
        self.views = {topic: EngineView(model) for topic in endpoints}
        self.seqs: dict[str, list[int]] = {topic: [] for topic in endpoints}  # applied, in order
        self.received: dict[str, list[int]] = {topic: [] for topic in endpoints}  # off the SUB socket, in order
        self.replays = replays or {}
        self.num_replayed = 0  # batches taken from a replay socket
        self.sockets = {}
        self.monitors: list[zmq.Socket] = []  # each socket's connections made (the handshake done)
        self.poller = zmq.Poller()
        for topic, endpoint in endpoints.items():
            socket = self.context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self.monitors.append(socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
            if binds:
                socket.bind(endpoint)
            else:
                socket.connect(endpoint)
            self.sockets[socket] = topic
            self.poller.register(socket, zmq.POLLIN)

    def drain(self, quiet_s: float = 0.3) -> int:
        """Applies every batch that arrives until none has for quiet_s; returns how many."""
        count = 0
        while ready := dict(self.poller.poll(quiet_s * 1000)):
            for socket in ready:
                topic, seq, payload = socket.recv_multipart()
                self.received[topic.decode()].append(int.from_bytes(seq, "big"))
                self._take(topic.decode(), int.from_bytes(seq, "big"), payload)
                count += 1
        return count

    def wait_connected(self, timeout_s: float = 10.0) -> None:
        """Waits until each socket has made a connection (what an engine that binds sends from then on
        reaches it, once the subscription has crossed: microseconds)."""
        for monitor in self.monitors:
            assert monitor.poll(timeout_s * 1000), "no connection made"
            monitor.recv_multipart()

    def wait_for(self, topic: str, next_seq: int, timeout_s: float = 30.0) -> None:
        """Applies batches until every one numbered below next_seq is."""
        deadline, quiet = time.monotonic() + timeout_s, 0
        while len(self.seqs[topic]) < next_seq:
            assert time.monotonic() < deadline, f"batches up to {next_seq} did not arrive"
            quiet = 0 if self.drain(0.01) else quiet + 1
            if quiet >= 20:  # sent before the subscription took hold, and nothing after to show the gap
                self._replay(topic, len(self.seqs[topic]))
                quiet = 0

    def _take(self, topic: str, seq: int, payload: bytes) -> None:
        applied = self.seqs[topic]
        if seq > len(applied):
            self._replay(topic, len(applied))  # from the first one missing, this one too if buffered
        if seq < len(applied):  # applied already (replayed)
            return
        if seq == 1 and not applied:  # batch 0 lost to the connection being made: there was nothing to clear
            applied.append(0)
        assert seq == len(applied), f"batches {len(applied)}..{seq - 1} were lost"
        self._apply(topic, seq, payload)

    def _replay(self, topic: str, start: int) -> None:
        if topic not in self.replays:
            return
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replays[topic])
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            if int.from_bytes(seq, "big") == len(self.seqs[topic]):
                self._apply(topic, int.from_bytes(seq, "big"), payload)
                self.num_replayed += 1
        dealer.close(linger=0)

    def _apply(self, topic: str, seq: int, payload: bytes) -> None:
        ts, events, _rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and events
        for event in events:
            self.views[topic].apply(event)
        self.seqs[topic].append(seq)

    def close(self) -> None:
        self.context.destroy(linger=0)  # every socket closed first: a bare term() would wait for them

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc_info) -> None:  # a failed test's too, or the process could not exit
        self.close()
