"""Reasoning apart from the answer: the text a model writes before `</think>` (frontend process, HTTP
server; `--reasoning-parser`).

`deepseek_r1` and `qwen3` read a reply alike, as vLLM's current parsers do: a leading `<think>` is
dropped (DeepSeek-R1's and Qwen3-Thinking's templates write it into the prompt, so it may not be there),
everything before `</think>` is reasoning, the text after it the content, and a reply that never closes
it is all reasoning (cut short). Under `qwen3`, a request whose `chat_template_kwargs` turn thinking off
(`enable_thinking: false`) is all content. `openai_gptoss` is gpt-oss's analysis channel (harmony.py).
"""

from __future__ import annotations

from coreserve.frontend.server.parsers.harmony import HarmonyReasoning
from coreserve.frontend.server.parsers.tool_calls import held_back

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")


def is_thinking(parser: str, template_kwargs: dict | None) -> bool:
    """Whether a reply under `parser` begins in reasoning."""
    return parser != "qwen3" or (template_kwargs or {}).get("enable_thinking", True) is not False


def reasoning_splitter(
    parser: str, template_kwargs: dict | None, is_held: bool
) -> ThinkSplitter | HarmonyReasoning:
    """`parser`'s splitter for one choice; `is_held`: a tool choice's grammar holds the output to the
    calls from its first token (no <think> there; harmony's channels are read all the same)."""
    if parser == "openai_gptoss":
        return HarmonyReasoning()
    return ThinkSplitter(is_thinking(parser, template_kwargs) and not is_held)


class ThinkSplitter:
    """One choice's text, fed as it grows, to (reasoning delta, content delta)."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.text = ""
        self.sent = (0, 0)  # characters of reasoning and of content already sent
        self.searched = 0  # where the next search for </think> starts (each feed searches its new text)
        self.end: int | None = None  # where </think> is, once found

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self._split(final) if self.thinking else ("", self.text)
        sent_reasoning, sent_content = self.sent
        self.sent = (len(reasoning), len(content))
        return reasoning[sent_reasoning:], content[sent_content:]

    def _split(self, final: bool) -> tuple[str, str]:
        text = self.text
        body = text.lstrip()
        if body.startswith(START):
            text = body[len(START) :]
        elif not final and START.startswith(body):
            return "", ""  # the reply may yet open with <think>
        if self.end is None:
            found = text.find(END, max(0, self.searched - len(END)))
            self.searched = len(text)
            self.end = None if found == -1 else found
        end = self.end
        if end is not None:
            return text[:end], text[end + len(END) :]
        return (text if final else text[: len(text) - held_back(text, END)]), ""
