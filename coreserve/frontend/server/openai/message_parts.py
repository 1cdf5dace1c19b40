"""One chat choice's generated text to OpenAI's message parts: `reasoning_content`, `content` and
`tool_calls` (frontend process, HTTP server; docs/serving.md, "Tool calls and reasoning").

`ChoiceParser.feed` takes the text as it grows and gives each step's delta; the whole message is the
same parser fed the whole text at once, so a streamed answer's deltas add up to the whole one's. The
token ids and logprobs are the choice's own, untouched: every generated token's, inside calls and
reasoning too, and the text as generated goes alongside the parts (`raw_text`). A format that is the
whole reply's structure (harmony's) reads it under every tool choice; its calls count unless the choice
is `none`.
"""

from __future__ import annotations

import json

from coreserve.frontend.server.openai.tool_choice import ToolPlan
from coreserve.frontend.server.parsers.harmony import HarmonyReasoning
from coreserve.frontend.server.parsers.reasoning import ThinkSplitter
from coreserve.frontend.server.parsers.splitter import CallSplitter
from coreserve.frontend.server.parsers.tool_calls import ToolCall, arguments_text, call_id


class ChoiceParser:
    def __init__(
        self, plan: ToolPlan, think: ThinkSplitter | HarmonyReasoning | None, include_reasoning: bool = True
    ) -> None:
        self.plan, self.think, self.include_reasoning = plan, think, include_reasoning
        reads = plan.fmt is not None and (plan.mode == "auto" or plan.fmt.is_whole_reply)
        self.splitter = CallSplitter(plan.fmt) if reads else None
        self.make_id = plan.fmt.make_id if plan.fmt is not None and plan.fmt.make_id else call_id
        self.forced = ""  # required's and named's output: JSON
        self.num_calls = 0

    @property
    def is_parsing(self) -> bool:
        return self.think is not None or self.plan.mode != "none" or self.splitter is not None

    def feed(self, text: str, final: bool) -> dict:
        """The delta this text adds: any of reasoning_content, content, tool_calls."""
        delta: dict = {}
        reasoning, content = self.think.feed(text, final) if self.think is not None else ("", text)
        if reasoning and self.include_reasoning:
            delta["reasoning_content"] = reasoning
        calls: list[dict] = []
        if self.splitter is not None:
            content, found = self.splitter.feed(content, final)
            calls = [self._new_call(call) for call in found] if self.plan.mode != "none" else []
        elif self.plan.mode == "named":
            calls, content = self._named(content), ""
        elif self.plan.mode == "required":
            self.forced += content
            calls, content = (self._required() if final else []), ""
        if content:
            delta["content"] = content
        if not self.plan.parallel:
            calls = [call for call in calls if call["index"] == 0]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """vLLM's: "tool_calls" where auto or required ended on its own with calls; a named call keeps
        "stop", as OpenAI's."""
        if engine_reason == "stop" and self.num_calls and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason

    def message(self, whole: dict, echo: str) -> dict:
        """The whole answer's message from its one delta."""
        content = echo + whole.get("content", "")
        if not content and self.is_parsing and self.plan.mode not in ("required", "named"):
            content = None  # as vLLM: required's and named's are "" (the calls are the answer)
        message: dict = {"role": "assistant", "content": content}
        if self.think is not None:
            message["reasoning_content"] = whole.get("reasoning_content")
        if self.plan.mode != "none":
            calls = whole.get("tool_calls", [])
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
        return message

    def _new_call(self, call: ToolCall) -> dict:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        function = {"name": call.name, "arguments": call.arguments}
        return {"index": index, "id": self.make_id(), "type": "function", "function": function}

    def _named(self, text: str) -> list[dict]:
        """The named function's arguments as they are written: its first delta names it."""
        if self.num_calls:
            return [{"index": 0, "function": {"arguments": text}}] if text else []
        return [self._new_call(ToolCall(self.plan.name, text))]

    def _required(self) -> list[dict]:
        """`required`'s list of {"name", "parameters"}, once whole (none when it was cut short)."""
        try:
            items = json.loads(self.forced)
        except (ValueError, RecursionError):
            return []
        calls = []
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                arguments = arguments_text(item.get("parameters", {}))
                if arguments is not None:
                    calls.append(self._new_call(ToolCall(item["name"], arguments)))
        return calls
