"""What one request may cost the server before the engine sees it (frontend process, HTTP server).

`BodyLimitMiddleware` refuses a body over `--max-request-bytes` with a 413 in OpenAI's error shape: at
once when its Content-Length says so, or as soon as a streamed (chunked) body passes the limit; a body
is never buffered beyond the limit. `PromptBound` refuses, before tokenizing, a text that cannot fit the
context: a prompt of B bytes has at least B / (NORMALIZER_SLACK * longest token's bytes) tokens.
`Admission`: how much work the server takes on at once. With `--max-queued-requests Q` the server holds at most the engine's `max_num_seqs` + Q sequences
(running and waiting, each prompt times n counted); a request past that is refused at once with a 503,
`Retry-After` and OpenAI's error shape (code `overloaded`), instead of queueing without end and timing
out in silence. A request bigger than the bound alone is still taken when nothing else is held. Without
the flag nothing is bounded (vLLM's behaviour: a batch client may send thousands at once).
docs/serving.md.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coreserve.frontend.server.common.errors import APIError, error_response

# 8 MiB: a 128k-token context fits several times over in any JSON form a client sends (text ~4 bytes a
# token, \u-escaped non-Latin text 6 bytes a character, token ids ~7 bytes each), while one request's
# parse and tokenization stay bounded (docs/serving.md).
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# A tokenizer's normalizer may shrink the text before it is split into tokens: NFC composes up to three
# Hangul jamo (9 bytes) into one syllable (3 bytes). 4 covers that; no supported family removes text.
NORMALIZER_SLACK = 4


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, f"Content-Length {declared}")
            return
        chunks, num_bytes = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was in: nothing to answer
            chunks.append(message.get("body", b""))
            num_bytes += len(chunks[-1])
            if num_bytes > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (
            f"the request body ({size}) is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-bytes)"
        )
        await error_response(413, message, code="request_too_large")(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read ahead, in one message; then the connection's own messages (its disconnect)."""
    is_sent = False

    async def replayed() -> Message:
        nonlocal is_sent
        if is_sent:
            return await receive()
        is_sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


class PromptBound:
    """The fewest tokens a text can have, from the tokenizer's longest token (in UTF-8 bytes)."""

    def __init__(self, table, tokenizer) -> None:
        lengths = [len(text.encode("utf-8", "surrogateescape")) for text in table.decoded]
        added = [len(text.encode("utf-8")) for text in tokenizer.get_added_vocab()]
        self.max_token_bytes = max([1, *lengths, *added])

    def min_tokens(self, text: str) -> int:
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        per_token = NORMALIZER_SLACK * self.max_token_bytes
        return -(-num_bytes // per_token)

    def check(self, text: str, max_model_len: int, param: str) -> None:
        """A 400, before tokenizing, for a text that must have at least max_model_len tokens."""
        self._refuse(len(text), self.min_tokens(text), max_model_len, param)

    def check_length(self, num_chars: int, max_model_len: int, param: str) -> None:
        """`check` for a text known by its length alone (a character is at least a byte)."""
        self._refuse(num_chars, -(-num_chars // (NORMALIZER_SLACK * self.max_token_bytes)), max_model_len, param)

    def _refuse(self, num_chars: int, num_min: int, max_model_len: int, param: str) -> None:
        if num_min >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens; the {param} "
                f"({num_chars} characters) has at least {num_min} tokens",
                param,
            )


RETRY_AFTER_S = 1  # what Retry-After says: about one decode window of a loaded CPU server


class Admission:
    def __init__(self, max_num_seqs: int, max_queued: int | None) -> None:
        self.bound = None if max_queued is None else max_num_seqs + max_queued
        self.held = 0  # sequences admitted and not yet closed

    def admit(self, sequences: int) -> None:
        """Takes `sequences` on, or raises the 503."""
        if self.bound is not None and self.held and self.held + sequences > self.bound:
            raise APIError(
                503,
                f"the server is at its bound of {self.bound} sequences (max_num_seqs + --max-queued-requests) "
                f"and holds {self.held}: retry after {RETRY_AFTER_S} s",
                code="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.held += sequences

    def release(self, sequences: int) -> None:
        self.held -= sequences
