"""Tool calls and reasoning through /v1/chat/completions, driven by the official openai client on the
real SmolLM2 (docs/serving.md, "Tool calls and reasoning"): a weather conversation in several turns
under `required`, a named function and `auto`, streamed and whole; the exact token ids and logprobs
behind each call; reasoning apart from the content."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from server_harness import REPO, running_server

from coreserve.frontend.server.common.errors import APIError
from coreserve.frontend.server.openai.schemas import ChatCompletionRequest
from coreserve.frontend.server.openai.tool_choice import tool_plan

MODEL = "builtin:smollm2"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the qwen3 parser: no reasoning
# A hermes call the grammar writes through the model's own tokens, so that `auto` has one to parse
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server():
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
             "--max-model-len", "2048"]
    with running_server(*flags, model=MODEL) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def ask(client, messages, tool_choice, stream=False, max_tokens=48, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens, temperature=0,
        logprobs=True, stream=stream, extra_body={**NO_THINKING, "return_token_ids": True, **extra},
    )


def merged_stream(stream) -> dict:
    """A streamed answer merged as clients merge it."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish_reason": None, "token_ids": [], "logprobs": []}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            out["token_ids"] += (choice.model_extra or {}).get("token_ids") or []
            if choice.logprobs is not None:
                out["logprobs"] += [entry.logprob for entry in choice.logprobs.content]
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def test_weather_conversation_required_then_tool_result_then_auto(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask(client, messages, "required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0 if call.function.name == "get_weather" else 1]
                        ["function"]["parameters"])
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])  # every token's, the call's
    streamed = merged_stream(ask(client, messages, "required", stream=True))
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert streamed["token_ids"] == choice.model_extra["token_ids"]
    messages += [
        choice.message.model_dump(exclude_none=True),  # as the client gives it back (extra fields too)
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    answer = ask(client, messages, "auto")
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert message.tool_calls == [] and message.content  # this model answers in text: text it stays
    assert answer.choices[0].model_extra["raw_text"] == message.content
    streamed = merged_stream(ask(client, messages, "auto", stream=True))
    assert streamed["content"] == message.content and streamed["calls"] == {}


def test_a_named_function_streams_its_arguments(client):
    messages = [{"role": "user", "content": "Is it raining in Oslo?"}]
    whole = ask(client, messages, NAMED)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI: a named call ends as "stop"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    streamed = merged_stream(ask(client, messages, NAMED, stream=True))
    assert streamed["calls"][0]["name"] == "get_weather"
    assert streamed["calls"][0]["arguments"] == call.function.arguments
    # thinking on (the qwen3 parser's default): the grammar holds the output to the call from its start
    thinking = ask(client, messages, NAMED, chat_template_kwargs={"enable_thinking": True}).choices[0]
    assert thinking.message.tool_calls[0].function.arguments == call.function.arguments
    assert thinking.message.model_extra["reasoning_content"] is None


def test_auto_parses_the_calls_the_model_writes(client):
    """The call is written by the model's own tokens (a grammar holds it to a hermes call): parsed into
    tool_calls, with every token's logprob and the text as generated beside it."""
    messages = [{"role": "user", "content": "Weather in Paris or Rome?"}]
    whole = ask(client, messages, "auto", max_tokens=160, structured_outputs={"regex": HERMES_CALL})
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert choice.model_extra["raw_text"].startswith("<tool_call>\n")
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
    streamed = merged_stream(ask(client, messages, "auto", stream=True, max_tokens=160, structured_outputs={"regex": HERMES_CALL}))
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""
    assert streamed["calls"][0]["arguments"] == call.function.arguments
    assert streamed["logprobs"] == [entry.logprob for entry in choice.logprobs.content]
    parallel = ask(client, messages, "auto", max_tokens=160, structured_outputs={"regex": f"({HERMES_CALL}\n){{2}}"},
                   parallel_tool_calls=False)
    assert len(parallel.choices[0].message.tool_calls) == 1  # false: the first call only


def test_rollout_token_ids_are_the_templates_and_score_bit_for_bit(server, client):
    """A multi-turn rollout's prompt ids are the template's rendering of its history (tools, the
    assistant's calls, the tool's answer), and its completion's logprobs equal /v1/completions' on
    those very ids, bit for bit."""
    from coreserve.frontend.engine.engine_args import load_tokenizer
    from scripts.real_models import path_of

    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    answer = ask(client, messages, "auto")
    prompt_ids = answer.model_extra["prompt_token_ids"]
    tokenizer = load_tokenizer(str(path_of("smollm2-135m")))
    as_templates_read = [*messages[:1], {**messages[1], "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, *messages[2:]]
    text = tokenizer.apply_chat_template(as_templates_read, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    tokenized = httpx.post(server + "/tokenize", timeout=60, json={
        "model": MODEL, "messages": messages, "tools": TOOLS, "chat_template_kwargs": NO_THINKING["chat_template_kwargs"]})
    assert tokenized.json()["tokens"] == prompt_ids
    completion_ids = answer.choices[0].model_extra["token_ids"]
    scored = httpx.post(server + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt_ids + completion_ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert scored.status_code == 200, scored.text
    expected = scored.json()["choices"][0]["logprobs"]["token_logprobs"][len(prompt_ids):]
    assert [entry.logprob for entry in answer.choices[0].logprobs.content] == expected


def test_reasoning_is_apart_from_the_content(client):
    """qwen3's parser, thinking on: the reasoning a grammar makes the model write, then its answer."""
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0,
                logprobs=True)
    grammar = {"structured_outputs": {"regex": "<think>[a-z ]{3,12}</think>[A-Z][a-z ]{3,12}"}}
    whole = client.chat.completions.create(**body, extra_body=grammar)
    message = whole.choices[0].message
    raw = whole.choices[0].model_extra["raw_text"]
    assert message.model_extra["reasoning_content"] == raw[len("<think>"):raw.index("</think>")]
    assert message.content == raw[raw.index("</think>") + len("</think>"):]
    streamed = merged_stream(client.chat.completions.create(**body, stream=True, extra_body=grammar))
    assert (streamed["reasoning"], streamed["content"]) == (message.model_extra["reasoning_content"], message.content)
    hidden = client.chat.completions.create(**body, extra_body={**grammar, "include_reasoning": False})
    assert hidden.choices[0].message.model_extra["reasoning_content"] is None
    assert hidden.choices[0].message.content == message.content
    unclosed = client.chat.completions.create(**{**body, "max_tokens": 6})  # never closes: all reasoning
    assert unclosed.choices[0].message.content is None and unclosed.choices[0].message.model_extra["reasoning_content"]


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "does not match any"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "structured outputs"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", ""),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "more than one tool is named 'get_weather'"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"$ref": "#/$defs/missing"}}}]}, "tools", "make no grammar"),
    ({"chat_template_kwargs": {"tools": []}}, "messages", "chat_template_kwargs cannot set tools"),
])
def test_bad_tool_fields_are_400s_naming_them(server, change, param, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 2, **change}
    response = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_tool_choice_rules_as_vllm():
    """Pure logic: what a server without the auto flags answers (vLLM's words)."""
    plain = SimpleNamespace(enable_auto_tool_choice=False, tool_call_parser=None)
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(APIError, match="requires --enable-auto-tool-choice and --tool-call-parser"):
        tool_plan(plain, ChatCompletionRequest(messages=user, tools=TOOLS))  # tools alone: auto
    assert tool_plan(plain, ChatCompletionRequest(messages=user, tools=TOOLS, tool_choice="none")).mode == "none"
    required = tool_plan(plain, ChatCompletionRequest(messages=user, tools=TOOLS, tool_choice="required"))
    schema = json.loads(required.grammar.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    with pytest.raises(APIError, match="`tools` must be set"):
        tool_plan(plain, ChatCompletionRequest(messages=user, tool_choice="required"))


def test_an_unknown_parser_is_refused_at_start():
    for flag, name in (("--tool-call-parser", "nonesuch"), ("--reasoning-parser", "nonesuch")):
        done = subprocess.run([sys.executable, "-m", "coreserve", "serve", MODEL, flag, name], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "invalid choice: 'nonesuch'" in done.stderr
    done = subprocess.run([sys.executable, "-m", "coreserve", "serve", "builtin:nonesuch", "--enable-auto-tool-choice"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--enable-auto-tool-choice needs --tool-call-parser" in done.stderr


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city now",
                    "parameters": WEATHER_PARAMETERS, "strict": True}]


def test_responses_api_a_call_its_output_and_an_answer(client):
    """/v1/responses over chat: a required call, its output sent back as an item, then the answer;
    streamed through the client's own stream helper to the same final response."""
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
                                    tool_choice="required", max_output_tokens=48, temperature=0,
                                    extra_body=NO_THINKING)
    assert first.status == "completed" and first.id.startswith("resp")
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=RESPONSES_TOOLS,
                                 tool_choice="required", max_output_tokens=48, temperature=0,
                                 extra_body=NO_THINKING) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    [streamed_call] = [item for item in final.output if item.type == "function_call"]
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18}'}]
    answer = client.responses.create(model=MODEL, input=history, tools=RESPONSES_TOOLS, tool_choice="none",
                                     max_output_tokens=24, temperature=0, extra_body=NO_THINKING,
                                     include=["message.output_text.logprobs"])
    assert answer.output_text and answer.usage.output_tokens > 0
    assert answer.status == ("incomplete" if answer.usage.output_tokens == 24 else "completed")
    [message] = [item for item in answer.output if item.type == "message"]
    assert len(message.content[0].logprobs) == answer.usage.output_tokens
    with client.responses.stream(model=MODEL, input=history, tools=RESPONSES_TOOLS, tool_choice="none",
                                 max_output_tokens=24, temperature=0, extra_body=NO_THINKING) as stream:
        assert stream.get_final_response().output_text == answer.output_text


def test_responses_api_reasoning_items(client):
    grammar = {"structured_outputs": {"regex": "<think>[a-z ]{3,12}</think>[A-Z][a-z ]{3,12}"}}
    # structured_outputs is not a Responses field: the reasoning is what the model writes unforced
    answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0)
    assert [item.type for item in answer.output] == ["reasoning"]  # qwen3, thinking on, never closed
    assert answer.output[0].content[0].text and answer.status == "incomplete"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", extra_body=grammar)
    assert info.value.body["param"] == "structured_outputs"
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=True)
    assert stored.store is False  # nothing is stored; the default store: true is answered so, as vLLM
    for change, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"reasoning": {"effort": "high"}}, "reasoning")):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input="Hi", **change)
        assert info.value.body["param"] == param
