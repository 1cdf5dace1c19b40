"""What every tool-call format is made of: a call, a format, call ids, arguments as JSON text, markers
held back (frontend process, HTTP server; the formats by name and the splitter: splitter.py).

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
    # Its markers structure the whole reply (harmony's channels): read under every tool choice, and
    # required's and named's grammar writes them too (openai/harmony_fields.py)
    is_whole_reply: bool = False


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
