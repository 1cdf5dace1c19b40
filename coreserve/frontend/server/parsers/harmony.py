"""gpt-oss's harmony replies read into messages: the `openai` tool-call format (content and calls) and the
`openai_gptoss` reasoning parser (the analysis channel) (frontend process, HTTP server; docs/serving.md).

The prompt ends with `<|start|>assistant`, so a reply opens with its first message's header:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A header names the channel (`<|channel|>NAME`), maybe a recipient (`to=NAME`, before or after the
channel) and a content type (`json`, `<|constrain|>json`), read as openai-harmony's parser reads them; a
message ends at `<|end|>`, `<|call|>` or `<|return|>` (the last two are stop tokens: the reply's text
ends there, without them). As vLLM sorts the messages: one to a function (`functions.NAME`, or a bare
name that is not a built-in tool's) is a call, its JSON arguments written back by json.dumps; the
analysis channel is reasoning (a built-in tool's call there too); the final channel, and commentary to
no one (a preamble), are content; the rest (a built-in tool's call elsewhere, other roles) is dropped. Messages of one kind are joined by a newline.
Text that is not harmony (a header that cannot be read, a reply a grammar held to plain JSON) is content
from the message it begins, as written, once the reply has ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from coreserve.frontend.server.parsers.tool_calls import CallFormat, Part, ToolCall, call_id, held_back

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
ROLES = ("system", "developer", "user", "assistant", "tool")
BUILT_IN_TOOLS = ("browser", "python", "container")  # their calls are not function calls (vLLM's list)
FUNCTIONS = "functions."


@dataclass(frozen=True)
class Message:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str  # so far, where `is_done` is false (a marker's possible start held back)
    is_done: bool

    @property
    def kind(self) -> str:
        """"call", "reasoning", "content" or "dropped", as vLLM's harmony parser sorts a message."""
        if self.role != "assistant":
            return "dropped"
        if self.recipient is not None and _is_function(self.recipient):
            return "call"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return "content"
        return "dropped"


def read(text: str, final: bool) -> tuple[list[Message], str | None]:
    """The reply's messages so far, and the text that is not harmony (None while there is none). A
    message or header still being written is left for later unless `final`."""
    messages: list[Message] = []
    pos, has_role = 0, True  # the prompt's <|start|>assistant opened the first message
    while pos < len(text):
        opened = pos
        if not has_role:
            if not text.startswith(START, pos):
                return messages, (None if not final and START.startswith(text[pos:]) else text[opened:])
            pos += len(START)
        at = text.find(MESSAGE, pos)
        broken = _first_end(text, pos, len(text) if at == -1 else at)
        if broken is not None or (at == -1 and final):
            return messages, text[opened:]
        if at == -1:
            return messages, None  # a header still being written
        header = _header(text[pos:at], "assistant" if has_role else None)
        if header is None:
            return messages, text[opened:]
        start = at + len(MESSAGE)
        end = _first_end(text, start, len(text))
        if end is None:
            body = text[start:] if final else text[start : len(text) - _held(text[start:])]
            messages.append(Message(*header, body, final))
            return messages, None
        messages.append(Message(*header, text[start : end[0]], True))
        pos, has_role = end[1], False
    return messages, None


def _first_end(text: str, start: int, stop: int) -> tuple[int, int] | None:
    """(where, after) the first end marker in text[start:stop], or None."""
    found = [(at, at + len(marker)) for marker in ENDS if (at := text.find(marker, start, stop)) != -1]
    return min(found) if found else None


def _held(tail: str) -> int:
    return max(held_back(tail, marker) for marker in ENDS)


def _header(header: str, role: str | None) -> tuple[str, str | None, str | None, str | None] | None:
    """(role, channel, recipient, content type) as openai-harmony reads a header; None where it cannot."""
    channel = None
    at = header.find(CHANNEL)
    if at != -1:
        after = header[at + len(CHANNEL) :]
        size = next((i for i, c in enumerate(after) if c.isspace() or c == "<"), len(after))
        if size == 0:
            return None
        channel, header = after[:size], header[:at] + after[size:]
    parts = header.strip().replace(CONSTRAIN, " " + CONSTRAIN).split()
    if role is None:
        if not parts:
            return None
        name = parts.pop(0)
        if name not in ROLES and not parts and not name.startswith("to="):
            return None
        role = name if name in ROLES else "tool"  # an unknown role before more is a tool's name
    elif parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to=") or not parts:
            recipient = last.removeprefix("to=")
        else:
            content_type, recipient = last, parts.pop().removeprefix("to=")
    return None if parts else (role, channel, recipient, content_type)


def _is_function(recipient: str) -> bool:
    """vLLM's rule: `functions.NAME`, or a bare name that is not the assistant, a marker or a built-in."""
    if recipient.startswith(FUNCTIONS):
        return len(recipient) > len(FUNCTIONS)
    return bool(recipient) and not recipient.startswith("<|") and recipient != "assistant" and (
        recipient.split(".", 1)[0] not in BUILT_IN_TOOLS
    )


def _call(message: Message) -> ToolCall:
    """A call message as vLLM's: JSON arguments (no content type, or one naming json) written back by
    json.dumps; anything else as written."""
    arguments = message.text
    if message.content_type is None or "json" in message.content_type:
        try:
            arguments = json.dumps(json.loads(arguments))
        except (ValueError, RecursionError):
            pass
    return ToolCall(message.recipient.removeprefix(FUNCTIONS), arguments)


def scan(text: str, final: bool) -> list[Part]:
    """The `openai` format: the content (messages joined by a newline) and the finished calls, in order;
    reasoning is the reasoning parser's."""
    messages, rest = read(text, final)
    parts: list[Part] = []
    has_content = False
    for message in messages:
        if message.kind == "call" and message.is_done:
            parts.append(_call(message))
        elif message.kind == "content":
            parts += ["\n", message.text] if has_content else [message.text]
            has_content = True
    if rest is not None and final:
        parts += ["\n", rest] if has_content else [rest]
    return parts


def reasoning(text: str, final: bool) -> str:
    """The analysis channel's text so far, its messages joined by a newline."""
    return "\n".join(m.text for m in read(text, final)[0] if m.kind == "reasoning")


class HarmonyReasoning:
    """`openai_gptoss`: one choice's text, fed as it grows, to (reasoning delta, the text delta). The
    text goes on whole: the `openai` format (scan above) reads the content and calls from the same
    messages."""

    def __init__(self) -> None:
        self.text = ""
        self.num_sent = 0  # characters of reasoning already sent

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        text = reasoning(self.text, final)
        fresh, self.num_sent = text[self.num_sent :], max(self.num_sent, len(text))
        return fresh, delta


FORMAT = CallFormat("openai", scan, make_id=call_id, is_whole_reply=True)
