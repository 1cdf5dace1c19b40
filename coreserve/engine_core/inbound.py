"""Client frames, one at a time, into work for the busy loop (engine-core process, input thread).

Owns three rules: a frame that cannot be decoded or handled is dropped alone (counted, logged at a
limited rate), never the thread; a client is served only after a successful handshake; a request
that does not decode is refused alone, with its id and the reason, while the rest of its frame runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from coreserve.protocol import PROTOCOL_VERSION
from coreserve.protocol.codec import Codec
from coreserve.protocol.messages import (
    AddRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Goodbye,
    HandshakeReply,
    Hello,
)

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0  # at most one log line per kind of dropped frame in this time


@dataclass
class Inbound:
    """What one frame asks for: a message for the busy loop and/or a reply to send back at once."""

    to_core: object | None = None
    reply: msgspec.Struct | None = None


@dataclass
class DecodedRequests:
    """AddRequests after per-request decoding: the busy loop queues these as one batch."""

    requests: list[EngineCoreRequest]


@dataclass
class FrameReader:
    facts: Callable[[], HandshakeReply]
    tokenizer_fingerprint: str
    codec: Codec = field(default_factory=Codec)
    greeted: set[bytes] = field(default_factory=set)  # clients whose handshake succeeded
    num_dropped: int = 0
    _last_log: dict[str, float] = field(default_factory=dict)

    def read(self, client: bytes, frame: memoryview) -> Inbound:
        """Never raises: whatever goes wrong drops this frame alone."""
        try:
            return self._read(client, frame)
        except Exception as exc:  # hostile frames reach past DecodeError (RecursionError, MemoryError...)
            self.drop("malformed", client, f"{type(exc).__name__}: {exc}")
            return Inbound()

    def drop(self, kind: str, client: bytes, reason: str) -> None:
        self.num_dropped += 1
        self._log(
            kind,
            "dropped a %s frame from client %s (%d dropped so far): %s",
            kind,
            client.hex()[:16],
            self.num_dropped,
            reason[:200],
        )

    def _log(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[kind] = now
            logger.warning(message, *args)

    def _read(self, client: bytes, frame: memoryview) -> Inbound:
        message = self.codec.decode_client(frame)
        if isinstance(message, Hello):
            return Inbound(reply=self._handshake(client, message))
        if client not in self.greeted:
            self.drop("unGreeted", client, f"{type(message).__name__} before a successful handshake")
            return Inbound()
        if isinstance(message, Goodbye):
            self.greeted.discard(client)
        if isinstance(message, AddRequests):
            return self._requests(message)
        return Inbound(to_core=message)

    def _handshake(self, client: bytes, hello: Hello) -> HandshakeReply:
        reply = self.facts()
        if hello.protocol_version != PROTOCOL_VERSION:
            reply.error = f"protocol version {hello.protocol_version} != the core's {PROTOCOL_VERSION}"
        elif hello.tokenizer_fingerprint != self.tokenizer_fingerprint:
            reply.error = "the frontend's tokenizer does not match the model's tokenizer"
        if reply.error is None:
            self.greeted.add(client)
        else:
            self.greeted.discard(client)
            self._log("refused", "refused client %s: %s", client.hex()[:16], reply.error)
        return reply

    def _requests(self, message: AddRequests) -> Inbound:
        requests, refusals = [], []
        for raw in message.requests:
            try:
                requests.append(self.codec.decode_request(raw))
            except Exception as exc:
                refusal = _refusal(raw, f"the request is malformed: {exc}")
                if refusal is None:
                    self.drop("request", b"", f"a request without a readable id: {exc}")
                else:
                    refusals.append(refusal)
        reply = EngineCoreOutputs(refusals, time.time()) if refusals else None
        return Inbound(to_core=DecodedRequests(requests) if requests else None, reply=reply)


def _refusal(raw: msgspec.Raw, reason: str) -> EngineCoreOutput | None:
    """An error output for a request that did not decode, if its id (field 0) can be read."""
    try:
        fields = msgspec.msgpack.decode(raw)
    except Exception:
        return None
    if isinstance(fields, list) and fields and isinstance(fields[0], str):
        return EngineCoreOutput(fields[0], [], finish_reason=FinishReason.ERROR, error=reason)
    return None
