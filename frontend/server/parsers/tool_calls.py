"""What every tool-call format shares: a call, a format, and the one splitter that turns any format's scan
of a growing text into content and calls (frontend process, HTTP server; the formats by name: registry.py).

A format is a `scan(text, final)` function: the text's parts in order, each plain text (the message's
content) or a `ToolCall`, covering a prefix of the text; what it leaves uncovered (a call not yet closed,
the start of a marker) it is not sure of yet and is scanned again when more text has come. With `final`
the whole text is covered. A scan of a longer text keeps the parts of the shorter one, so each part is
sent once: the streamed deltas and the whole message are the same splitter fed in pieces or at once.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


Part = str | ToolCall


@dataclass(frozen=True)
class CallFormat:
    name: str
    scan: Callable[[str, bool], list[Part]]
    keep_special_tokens: bool = True  # its markers may be special tokens, kept in the text (as vLLM)
    make_id: Callable[[], str] | None = None  # the format's own call ids (Mistral's 9 characters)


def call_id() -> str:
    """vLLM's form of a tool call's id."""
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def mistral_call_id() -> str:
    """Mistral's templates take only ids of nine letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def arguments_text(arguments: object) -> str | None:
    """A call's arguments as JSON text, as vLLM writes them: an object as json.dumps writes it (non-ASCII
    kept); a string that holds an object's JSON is that object (not encoded twice). None for what JSON
    cannot hold (NaN, nesting past Python's recursion limit)."""
    try:
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


def held_back(tail: str, marker: str) -> int:
    """How many of `tail`'s last characters could begin `marker` (not sent until more text decides)."""
    for size in range(min(len(tail), len(marker) - 1), 0, -1):
        if marker.startswith(tail[-size:]):
            return size
    return 0


class CallSplitter:
    """One choice's text, fed as it grows, to (content delta, new calls) under a format.

    Whitespace at the end of the content is held until more content follows it, and dropped at the end
    when the message has calls (the newlines a model writes around its calls are no answer). A scan that
    fails on text no format expects (JSON nested past the recursion limit) reads it all as content. A final scan
    may take back content a partial one gave (a reply that turns out to be calls, as vLLM parses it
    whole): what was streamed stays streamed, and the whole message has the final scan's content."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.scanned = ""  # the scanned content so far: sent, or held as whitespace
        self.held = ""
        self.sent_calls = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCall]]:
        self.text += delta
        try:
            parts = self.fmt.scan(self.text, final)
        except (RecursionError, MemoryError):
            parts = [self.text] if final else []
        content = "".join(p for p in parts if isinstance(p, str))
        calls = [p for p in parts if isinstance(p, ToolCall)]
        if content.startswith(self.scanned):
            self.held += content[len(self.scanned) :]
            self.scanned = content
        if final and not calls:
            out, self.held = self.held, ""
        else:
            out = self.held.rstrip()
            self.held = self.held[len(out) :]
        fresh, self.sent_calls = calls[self.sent_calls :], max(self.sent_calls, len(calls))
        return out, fresh
