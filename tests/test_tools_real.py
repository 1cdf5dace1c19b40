"""Tool calls through the openai client on a real tool-trained file whose template renders tools:
Qwen2.5-Coder-1.5B-Instruct Q4_K_M (scripts/setup.sh fetches it), or another real file named by
CORESERVE_TOOLS_MODEL (`qwen2.5-coder-0.5b`). A weather conversation: a `required` call whose arguments
follow the schema, the tool's answer, then `auto` and a named call, streamed and whole; the prompt ids
are the template's rendering of the history (tools, the call, the tool's answer), and every token's
logprob equals /v1/completions' on those ids, bit for bit."""

from __future__ import annotations

import json
import os
import sys

import httpx
import jsonschema
import openai
import pytest
from conftest import ROOT
from server_harness import running_server
from test_server_tools import NAMED, TOOLS, WEATHER_PARAMETERS, merged_stream

sys.path.insert(0, str(ROOT / "scripts"))
from real_models import path_of  # noqa: E402

NAME = os.environ.get("CORESERVE_TOOLS_MODEL", "qwen2.5-coder-1.5b")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    path = path_of(NAME)
    assert path.exists(), f"{path} is missing: run `python scripts/real_models.py {NAME}`"
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "1024"]
    with running_server(*flags, model=str(path), startup_timeout_s=300) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, messages, tool_choice, stream=False):
    return client.chat.completions.create(
        model=str(path_of(NAME)), messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=96,
        temperature=0, logprobs=True, stream=stream, extra_body={"return_token_ids": True},
    )


def test_weather_conversation_on_a_real_file(server, client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = ask(client, messages, "required").choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert len(first.logprobs.content) == len(first.model_extra["token_ids"])
    streamed = merged_stream(ask(client, messages, "required", stream=True))
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in first.message.tool_calls]
    messages += [
        first.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    whole = ask(client, messages, "auto")
    answer = whole.choices[0]
    raw = answer.model_extra["raw_text"]
    check_ids_and_logprobs(server, messages, whole)
    if answer.message.tool_calls:  # a hermes call: parsed, its arguments JSON
        assert answer.finish_reason == "tool_calls" and "<tool_call>" in raw
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in answer.message.tool_calls)
    else:  # text (this file often writes its calls as a Markdown block): text it stays
        assert answer.message.content == raw and answer.finish_reason in ("stop", "length")
    named = ask(client, messages[:1], NAMED).choices[0]
    jsonschema.validate(json.loads(named.message.tool_calls[0].function.arguments), WEATHER_PARAMETERS)
    streamed = merged_stream(ask(client, messages[:1], NAMED, stream=True))
    assert streamed["calls"][0]["arguments"] == named.message.tool_calls[0].function.arguments


def check_ids_and_logprobs(server: str, messages: list[dict], answer) -> None:
    """The prompt ids are the template's rendering of the history as templates read it (the call's
    arguments an object), and the completion's logprobs equal /v1/completions' scoring, bit for bit."""
    from coreserve.frontend.engine.engine_args import load_tokenizer

    tokenizer = load_tokenizer(str(path_of(NAME)))
    history = [
        {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages
    ]
    text = tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in text and "<tool_call>" in text and "<tool_response>" in text  # this template renders them
    prompt_ids = answer.model_extra["prompt_token_ids"]
    assert prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    completion_ids = answer.choices[0].model_extra["token_ids"]
    scored = httpx.post(server + "/v1/completions", timeout=300, json={
        "model": str(path_of(NAME)), "prompt": prompt_ids + completion_ids, "max_tokens": 0, "echo": True,
        "logprobs": 0})
    assert scored.status_code == 200, scored.text
    expected = scored.json()["choices"][0]["logprobs"]["token_logprobs"][len(prompt_ids):]
    assert [entry.logprob for entry in answer.choices[0].logprobs.content] == expected


def test_llm_chat_and_the_server_render_tools_alike():
    """LLM.chat's tools and chat_template_kwargs reach the template as the server's do (chat_render_args,
    one function): the history's call arguments, JSON text in OpenAI's messages, decoded for the template; the
    sandbox's text is apply_chat_template's on the real template."""
    from coreserve.frontend.engine.chat_template import chat_render_args
    from coreserve.frontend.engine.engine_args import load_tokenizer
    from coreserve.frontend.engine.template_sandbox import TemplateSandbox

    tokenizer = load_tokenizer(str(path_of(NAME)))
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    sandbox = TemplateSandbox(30.0, 1 << 20, num_workers=1)
    try:
        text = sandbox.render(*chat_render_args(tokenizer, messages, None, True, TOOLS, {"enable_thinking": False}))
        with pytest.raises(ValueError, match="cannot set tools"):
            chat_render_args(tokenizer, messages, None, True, None, {"tools": []})
    finally:
        sandbox.close()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert '"name": "get_time"' in text and "<tool_response>\nrain\n</tool_response>" in text
    decoded = [*messages[:1], {**messages[1], "tool_calls": [{**call, "function": {
        "name": "get_weather", "arguments": {"city": "Oslo"}}}]}, messages[2]]
    expected = tokenizer.apply_chat_template(
        decoded, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == expected
