"""Encoders and typed decoders for each direction of the socket. No pickle: only the closed unions decode."""

from __future__ import annotations

import msgspec

from coreserve.protocol.messages import AddRequests, ClientMessage, CoreMessage, EngineCoreRequest


class Codec:
    """One encoder and one typed decoder per direction; cheap to build, keep one per thread."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._client_decoder = msgspec.msgpack.Decoder(ClientMessage)
        self._request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._core_decoder = msgspec.msgpack.Decoder(CoreMessage)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def encode_requests(self, requests: list[EngineCoreRequest]) -> bytes:
        return self._encoder.encode(AddRequests.of(requests, self._encoder))

    def decode_client(self, frame: bytes | memoryview) -> ClientMessage:
        """Raises msgspec.DecodeError / ValidationError for a malformed frame (or any error a hostile
        frame can provoke, such as RecursionError: callers catch Exception)."""
        return self._client_decoder.decode(frame)

    def decode_request(self, raw: msgspec.Raw) -> EngineCoreRequest:
        return self._request_decoder.decode(raw)

    def decode_core(self, frame: bytes | memoryview) -> CoreMessage:
        return self._core_decoder.decode(frame)
