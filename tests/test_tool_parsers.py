"""The tool-call and reasoning parsers (coreserve/frontend/server/parsers/, coreserve/frontend/server/openai/message_parts.py)
on the cases of vLLM's own parser tests (tests/tool_use/, tests/reasoning/: model outputs and what vLLM
expects of them), whole and streamed in pieces of every size: a streamed reply's deltas add up to the
whole reply's message. Pure text: no model."""

from __future__ import annotations

import json

import pytest

from coreserve.frontend.server.openai.message_parts import ChoiceParser
from coreserve.frontend.server.openai.tool_choice import NO_TOOLS, ToolPlan
from coreserve.frontend.server.parsers.reasoning import ThinkSplitter, is_thinking
from coreserve.frontend.server.parsers.splitter import TOOL_FORMATS

PIECES = (1, 2, 3, 5, 8, 1000)


def auto(fmt: str, parallel: bool = True) -> ToolPlan:
    return ToolPlan("auto", fmt=TOOL_FORMATS[fmt], parallel=parallel)


def whole(plan: ToolPlan, text: str, think: str | None = None) -> dict:
    parser = ChoiceParser(plan, ThinkSplitter(True) if think else None)
    return parser.message(parser.feed(text, final=True), "")


def streamed(plan: ToolPlan, text: str, size: int, think: str | None = None) -> dict:
    """The deltas of `text` fed `size` characters at a time, merged as a client merges them."""
    parser = ChoiceParser(plan, ThinkSplitter(True) if think else None)
    merged: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for start in range(0, max(len(text), 1), size):
        delta = parser.feed(text[start : start + size], final=start + size >= len(text))
        merged["content"] += delta.get("content", "")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = merged["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            assert ("id" in call) == (entry["name"] == ""), "the id comes with a call's first delta only"
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call["function"].get("arguments", "")
    return merged


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def check(plan: ToolPlan, text: str, content: str | None, calls: list[tuple[str, dict]]) -> None:
    message = whole(plan, text)
    assert message["content"] == content
    assert calls_of(message) == calls
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"]
    for size in PIECES:
        merged = streamed(plan, text, size)
        assert [(c["name"], json.loads(c["arguments"])) for c in merged["tool_calls"].values()] == calls, size
        if calls:
            assert [c["arguments"] for c in merged["tool_calls"].values()] == [
                c["function"]["arguments"] for c in message["tool_calls"]]
        assert (merged["content"] or None) == content, size


TRIGGER = '{"name": "final_answer", "arguments": {"trigger": true}}'
WEATHER = {"city": "San Francisco", "metric": "celsius"}


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("This is not a tool call.", "This is not a tool call.", []),
    (f"<tool_call>\n{TRIGGER}\n</tool_call>", None, [("final_answer", {"trigger": True})]),
    (f"<tool_call>\n{TRIGGER}", None, [("final_answer", {"trigger": True})]),  # ended before closing
    (f"<tool_call>\n{TRIGGER[:-1]}", f"<tool_call>\n{TRIGGER[:-1]}", []),  # not JSON: all content
    ('<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>',
     None, [("get_db_config", {"param": "max_connections"})]),
    ('Sure, let me check the weather.<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}</tool_call>',
     "Sure, let me check the weather.", [("get_weather", {"city": "NYC"})]),
    ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
     '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>',
     None, [("search", {"q": "cats"}), ("search", {"q": "dogs"})]),
    ('<tool_call>{"name": "get_current_temperature", "arguments": {"location": "San Francisco", "unit": '
     '"celsius"}}</tool_call>\n\n ', None,
     [("get_current_temperature", {"location": "San Francisco", "unit": "celsius"})]),
    ('。\n</think>\n\n<tool_call>\n{"name": "internet_search", "arguments": {"question": "5MW燃气轮机"}}\n</tool_call>',
     "。\n</think>", [("internet_search", {"question": "5MW燃气轮机"})]),  # vLLM keeps the whitespace
])
def test_hermes(text, content, calls):
    check(auto("hermes"), text, content, calls)


def test_hermes_a_call_then_one_cut_short_keeps_the_call():
    """vLLM's whole-reply parse turns such a reply into content; its stream had sent the first call. Here
    both keep the first call (a reply cut by max_tokens in its second call)."""
    text = f"<tool_call>\n{TRIGGER}\n</tool_call>\n<tool_call>\n{{\"name\": \"final_answer\", \"argum"
    check(auto("hermes"), text, None, [("final_answer", {"trigger": True})])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_text_no_format_expects_is_content_not_a_failure(fmt):
    """JSON nested past Python's recursion limit, NaN arguments, a huge expression: content, no call."""
    deep = "[" * 5000 + "]" * 5000
    for text in (f"<tool_call>{deep}</tool_call>", '{"name": "f", "parameters": ' + deep[:-1],
                 f"[TOOL_CALLS]f{{\"a\": {deep}}}", "[f(a=" + "1+" * 50000 + "1)]",
                 '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', '{"name": "f", "parameters": {"x": NaN}}'):
        message = whole(auto(fmt), text)
        assert message["tool_calls"] == [] and message["content"] == text
        streamed(auto(fmt), text, 997)


def test_hermes_arguments_as_vllm_writes_them():
    message = whole(auto("hermes"), f"<tool_call>\n{TRIGGER}\n</tool_call>")
    assert message["tool_calls"][0]["function"]["arguments"] == '{"trigger": true}'
    message = whole(auto("hermes"), '<tool_call>{"name": "do_thing", "arguments": "hello"}</tool_call>')
    assert message["tool_calls"][0]["function"]["arguments"] == '"hello"'
    chinese = '<tool_call>{"name": "s", "arguments": {"q": "燃气轮机"}}</tool_call>'
    assert whole(auto("hermes"), chinese)["tool_calls"][0]["function"]["arguments"] == '{"q": "燃气轮机"}'


L6 = ('{"name": "searchTool", "parameters": {"query": "test1"}}; {"name": "getOpenIncidentsTool", "parameters": {}}; '
      '{"name": "searchTool", "parameters": {"query": "test2"}}')
L6_CALLS = [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}', None,
     [("searchTool", {"query": "test query", "limit": 10})]),
    ("This is just some text without any tool calls", "This is just some text without any tool calls", []),
    ('{"name": "invalidTool", "parameters": {invalid json}', '{"name": "invalidTool", "parameters": {invalid json}', []),
    ('{"name": "searchTool", "arguments": {"query": "test"}}', None, [("searchTool", {"query": "test"})]),
    (L6, None, L6_CALLS),
    (L6.replace("; ", " ; "), None, L6_CALLS),
    ('<|python_tag|>{"name": "complexTool", "parameters": {"level1": {"level2": {"value": "deep"}}}}', None,
     [("complexTool", {"level1": {"level2": {"value": "deep"}}})]),
    ('{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": {"inner": "more {brackets}"}}}',
     None, [("searchTool", {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}})]),
    ('{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}', None,
     [("parserTool", {"text": 'He said "Hello {world}"'})]),
    ('{"parameters": {}}', '{"parameters": {}}', []),
    ('{"name": "toolWithoutParams"}', '{"name": "toolWithoutParams"}', []),
    ('{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.', None,
     [("searchTool", {"query": "test"})]),
    ('{"name": "searchTool", "parameters": {"query": "test"}} The arguments I passed were {"query": "test"}', None,
     [("searchTool", {"query": "test"})]),
])
def test_llama3_json(text, content, calls):
    check(auto("llama3_json"), text, content, calls)


def test_llama3_json_prose_before_calls():
    """vLLM's whole-reply parse finds calls after prose (and drops the prose); its stream sent the prose
    as content first. coreserve does both the same: the whole message has the calls alone."""
    text = "Here are the results: " + L6 + " Would you like to know more?"
    message = whole(auto("llama3_json"), text)
    assert message["content"] is None and [name for name, _ in calls_of(message)] == [n for n, _ in L6_CALLS]
    for size in PIECES[:-1]:  # the stream sends the prose up to the first brace, then the calls, once each
        merged = streamed(auto("llama3_json"), text, size)
        assert merged["content"] == "Here are the results:" and len(merged["tool_calls"]) == 3
    merged = streamed(auto("llama3_json"), 'Sure {"name": "f", "parameters": {"a": 1}}', 8)
    assert merged["content"] == "Sure" and [c["name"] for c in merged["tool_calls"].values()] == ["f"]
    merged = streamed(auto("llama3_json"), "Use {x} in the format string.", 3)  # braces, no call: all content
    assert merged["content"] == "Use {x} in the format string." and merged["tool_calls"] == {}


P1 = "get_weather(city='San Francisco', metric='celsius')"
P2 = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
      "passed_test=True, aliases=['John', 'Johnny'])")
P2_ARGS = {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"}, "role": None,
           "passed_test": True, "aliases": ["John", "Johnny"]}


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("How can I help you today?", "How can I help you today?", []),
    (f"[{P1}]", None, [("get_weather", WEATHER)]),
    (f"[{P2}]", None, [("register_user", P2_ARGS)]),
    ("[get_weather()]", None, [("get_weather", {})]),
    ("[do_something_cool(additional_data={})]", None, [("do_something_cool", {"additional_data": {}})]),
    ("[do_something_cool(steps=[])]", None, [("do_something_cool", {"steps": []})]),
    ("[get_weather(city='Martha\\'s Vineyard', metric='\\\"cool units\\\"')]", None,
     [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
    (f"[{P1}, {P2}]", None, [("get_weather", WEATHER), ("register_user", P2_ARGS)]),
    (f"[bad(x=b'z'), {P1}]", None, [("get_weather", WEATHER)]),
    (f"[calc(x=1e999), {P1}]", None, [("get_weather", WEATHER)]),
    ("[f(a='x 'y' 'z), g(b='p 'q' 'r)]", "[f(a='x 'y' 'z), g(b='p 'q' 'r)]", []),
    ("[set(flag=true, none=null)]", None, [("set", {"flag": True, "none": None})]),
    (f"<|python_start|>[{P1}]<|python_end|>", None, [("get_weather", WEATHER)]),
])
def test_pythonic(text, content, calls):
    check(auto("pythonic"), text, content, calls)


def test_pythonic_arguments_text():
    message = whole(auto("pythonic"), f"[{P2}]")
    assert message["tool_calls"][0]["function"]["arguments"] == json.dumps(P2_ARGS)


SF = {"city": "San Francisco", "state": "CA", "unit": "celsius"}


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("This is a test", "This is a test", []),
    ('[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', None, [("add", {"a": 3.5, "b": 4})]),
    ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": '
     '"celsius"}}]', None, [("get_current_weather", SF)]),
    ('[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, "name": '
     '"get_current_weather"}]', None, [("get_current_weather", SF)]),
    ('[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', None, [("get_age", {"name": "John Doe"})]),
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
     '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]', None,
     [("add", {"a": 3.5, "b": 4}), ("get_current_weather", SF)]),
    ('Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello", [("add", {"a": 1, "b": 2})]),
    ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": "TX", "unit": '
     '"fahrenheit"}}]\nextra trailing data', None,
     [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})]),
    ('[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail', None, [("add", {"a": 1, "b": 2})]),
    ("[TOOL_CALLS] not json at all", "not json at all", []),
    ('[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', None, [("add_this_and_that", {"a": 3.5, "b": 4})]),
    ('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', None,
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ('hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}', "hi{hi",
     [("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})]),
])
def test_mistral(text, content, calls):
    check(auto("mistral"), text, content, calls)


def test_mistral_ids_are_nine_characters():
    message = whole(auto("mistral"), '[TOOL_CALLS]add{"a": 1}')
    call_id = message["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("This is content", "This is content", None),
    ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("</think>This is the rest", "", "This is the rest"),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("\n<think>This is a reasoning section</think>\nThis is the rest", "This is a reasoning section", "\nThis is the rest"),
])
def test_reasoning(text, reasoning, content):
    """deepseek_r1's and (thinking on) qwen3's cases."""
    parser = ChoiceParser(NO_TOOLS, ThinkSplitter(True))
    message = parser.message(parser.feed(text, final=True), "")
    assert (message["reasoning_content"] or "", message["content"]) == (reasoning, content)
    for size in PIECES:
        merged = streamed(NO_TOOLS, text, size, think="on")
        assert (merged["reasoning_content"], merged["content"] or None) == (reasoning, content), size


def test_qwen3_thinking_off_is_all_content():
    assert is_thinking("qwen3", None) and is_thinking("deepseek_r1", {"enable_thinking": False})
    assert not is_thinking("qwen3", {"enable_thinking": False})
    parser = ChoiceParser(NO_TOOLS, ThinkSplitter(False))
    message = parser.message(parser.feed("This is plain content", final=True), "")
    assert message == {"role": "assistant", "content": "This is plain content", "reasoning_content": None}


def test_reasoning_then_calls():
    """Reasoning first, then the answer's calls: each in its own field, streamed the same."""
    text = "<think>I should look it up.</think>\n\n<tool_call>\n" + TRIGGER + "\n</tool_call>"
    parser = ChoiceParser(auto("hermes"), ThinkSplitter(True))
    message = parser.message(parser.feed(text, final=True), "")
    assert message["reasoning_content"] == "I should look it up."
    assert message["content"] is None and calls_of(message) == [("final_answer", {"trigger": True})]
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    for size in PIECES:
        merged = streamed(auto("hermes"), text, size, think="on")
        assert merged["reasoning_content"] == "I should look it up." and merged["content"] == ""
        assert len(merged["tool_calls"]) == 1


def test_not_parallel_keeps_the_first_call():
    text = ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>')
    assert calls_of(whole(auto("hermes", parallel=False), text)) == [("search", {"q": "cats"})]
    assert len(streamed(auto("hermes", parallel=False), text, 3)["tool_calls"]) == 1


def test_required_and_named():
    required = ToolPlan("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Vienna"}}, {"name": "get_time", "parameters": {}}]'
    message = whole(required, text)
    assert message["content"] == "" and calls_of(message) == [("get_weather", {"city": "Vienna"}), ("get_time", {})]
    assert whole(required, text[:20])["tool_calls"] == []  # cut short: no calls
    named = ToolPlan("named", name="get_weather")
    message = whole(named, '{"city": "Vienna"}')
    assert message["content"] == "" and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Vienna"}'}
    merged = streamed(named, '{"city": "Vienna"}', 4)
    assert merged["tool_calls"] == {0: {"name": "get_weather", "arguments": '{"city": "Vienna"}'}}
    parser = ChoiceParser(named, None)
    parser.feed("{}", final=True)
    assert parser.finish_reason("stop") == "stop"  # a named call keeps "stop", as OpenAI's


VLLM_TOOLS = [  # the tools of vLLM's test_tool_choice_required
    {"type": "function", "function": {"name": "get_current_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "state": {"type": "string"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}},
]
VIENNA = {"name": "get_current_weather", "parameters": {"city": "Vienna"}}
FORECAST = {"name": "get_forecast", "parameters": {"city": "Vienna", "days": 7}}


@pytest.mark.parametrize(("output", "matches"), [
    ([VIENNA], True),
    ([VIENNA, FORECAST], True),
    ([VIENNA, FORECAST, VIENNA, FORECAST], True),
    ([{"name": "get_current_weather", "parameters": {"city": "Vienna", "state": "W", "unit": "celsius"}}], True),
    (None, False),
    ([], False),
    ({}, False),
    ([{}], False),
    ([{"name": "get_current_weather"}], False),
    ([{"name": "get_current_weather", "parameters": {}}], False),
    ([{"name": "get_current_weather", "parameters": None}], False),
    (VIENNA, False),
    ([{"name": "get_current_weather", "parameters": {"city": "Vienna", "extra": 1}}], False),
    ([{"name": "get_forecast", "parameters": {"city": "Vienna"}}], False),
    ([{"name": "no_such_tool", "parameters": {"city": "Vienna"}}], False),
    ([VIENNA, {}], False),
])
def test_required_schema_holds_what_vllms_does(output, matches):
    """vLLM's test_tool_choice_required's outputs, against the schema `required` hands the grammar."""
    from types import SimpleNamespace

    import jsonschema

    from coreserve.frontend.server.openai.schemas import ChatCompletionRequest
    from coreserve.frontend.server.openai.tool_choice import tool_plan

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=VLLM_TOOLS, tool_choice="required")
    plan = tool_plan(SimpleNamespace(enable_auto_tool_choice=False, tool_call_parser=None), body)
    schema = json.loads(plan.grammar.json)
    assert jsonschema.Draft202012Validator(schema).is_valid(output) == matches
    if matches:  # and what the grammar let through becomes these calls
        message = whole(ToolPlan("required"), json.dumps(output))
        assert calls_of(message) == [(item["name"], item["parameters"]) for item in output]
