"""The tool-call formats by their vLLM names (`--tool-call-parser`), and the one splitter that turns any
format's scan of a growing text into content and calls (frontend process, HTTP server).

A format is a `scan(text, final)` function: the text's parts in order, each plain text (the message's
content) or a `ToolCall`, covering a prefix of the text; what it leaves uncovered (a call not yet closed,
the start of a marker) it is not sure of yet and is scanned again when more text has come. With `final`
the whole text is covered. A scan of a longer text keeps the parts of the shorter one, so each part is
sent once: the streamed deltas and the whole message are the same splitter fed in pieces or at once.
"""

from __future__ import annotations

from coreserve.frontend.server.parsers import harmony, hermes, llama3_json, mistral, pythonic
from coreserve.frontend.server.parsers.tool_calls import CallFormat, ToolCall

TOOL_FORMATS: dict[str, CallFormat] = {
    fmt.name: fmt for fmt in (hermes.FORMAT, llama3_json.FORMAT, mistral.FORMAT, pythonic.FORMAT, harmony.FORMAT)
}
TOOL_PARSERS = tuple(TOOL_FORMATS)


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
