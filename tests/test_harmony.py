"""gpt-oss's harmony (coreserve/frontend/server/parsers/harmony.py, openai/harmony_fields.py), against
openai-harmony, OpenAI's renderer and parser, run offline on o200k_base (tests/harmony_vocab.py).

Replies as text (no model): each read as openai-harmony's parser reads it, its messages sorted by vLLM's
rules, whole and streamed in pieces of every size. Then a tiny random gpt-oss with gpt-oss's real
tokenizer and the hub's template, served with `--tool-call-parser openai --reasoning-parser openai_gptoss`
and driven by the official openai client: the prompt's ids are the template's rendering and
openai-harmony's; a reasoning reply and a tool call (grammars make the random model write them),
streamed and whole, read as openai-harmony reads the same text, with logprobs equal to /v1/completions'
scoring of the same ids; `required` and a named function as one harmony call; /v1/responses' items;
what is not built refused by name.
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai_harmony as harmony
import pytest
from conftest import _SMALL, FAMILY_CONFIGS, TEST_DTYPE, peaked_init
from harmony_vocab import VOCAB_SIZE, tiktoken_dir
from real_tokenizers import VOCAB_DIR, real_tokenizer_path
from server_harness import REPO, running_server

from coreserve.frontend.server.openai.harmony_fields import call_grammar
from coreserve.frontend.server.openai.message_parts import ChoiceParser
from coreserve.frontend.server.openai.responses import ResponseShape
from coreserve.frontend.server.openai.responses_input import ResponsesRequest
from coreserve.frontend.server.openai.tool_choice import ToolPlan
from coreserve.frontend.server.parsers.harmony import FORMAT, HarmonyReasoning

PIECES = (1, 2, 3, 5, 8, 1000)
CONSTRAIN = "<|constrain|>"
EOS_IDS = [200002, 199999, 200012]  # <|return|>, <|endoftext|>, <|call|>: the hub's generation_config


@pytest.fixture(scope="module")
def encoding():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", tiktoken_dir(VOCAB_DIR))
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def reference(encoding, text: str) -> dict:
    """openai-harmony's messages of `text`, sorted as vLLM sorts them."""
    tokens = encoding.encode(text, allowed_special="all")
    messages = encoding.parse_messages_from_completion_tokens(tokens, harmony.Role.ASSISTANT, strict=False)
    out: dict = {"reasoning": [], "content": [], "calls": []}
    for message in messages:
        body, recipient, channel = message.content[0].text, message.recipient, message.channel
        if recipient is not None and CONSTRAIN in recipient:  # vLLM's: a content type read as a recipient
            recipient = recipient[: recipient.find(CONSTRAIN)].rstrip() or None
        if message.author.role != harmony.Role.ASSISTANT:
            continue
        if recipient and recipient != "assistant" and recipient.split(".")[0] not in ("browser", "python", "container"):
            arguments = body
            if message.content_type is None or "json" in message.content_type:
                try:
                    arguments = json.dumps(json.loads(body))
                except ValueError:
                    pass
            out["calls"].append((recipient.removeprefix("functions."), arguments))
        elif channel == "analysis":
            out["reasoning"].append(body)
        elif channel == "final" or (channel == "commentary" and recipient is None):
            out["content"].append(body)
    return {"reasoning": "\n".join(out["reasoning"]) or None, "content": "\n".join(out["content"]) or None,
            "calls": out["calls"]}


def parsed(text: str, size: int | None = None) -> dict:
    """Ours: the whole reply's message (size None), or its deltas `size` characters at a time, merged."""
    parser = ChoiceParser(ToolPlan("auto", fmt=FORMAT), HarmonyReasoning())
    if size is None:
        message = parser.message(parser.feed(text, final=True), "")
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        return {"reasoning": message["reasoning_content"] or None, "content": message["content"], "calls": calls}
    merged: dict = {"reasoning": "", "content": "", "calls": []}
    for start in range(0, max(len(text), 1), size):
        delta = parser.feed(text[start : start + size], final=start + size >= len(text))
        merged["reasoning"] += delta.get("reasoning_content", "")
        merged["content"] += delta.get("content", "")
        merged["calls"] += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])]
    return {"reasoning": merged["reasoning"] or None, "content": merged["content"] or None, "calls": merged["calls"]}


CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
REPLIES = [  # as a model writes them, its stop token (<|return|>, <|call|>) not in the text; vLLM's cases
    "<|channel|>analysis<|message|>This is reasoning",
    "<|channel|>final<|message|>This is a test",
    "<|channel|>analysis<|message|>I should think first.<|end|><|start|>assistant<|channel|>final<|message|>4.",
    CALL + '{"city": "Tokyo"}',
    "<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{\n\"city\": \"Tokyo\"\n}",
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',  # the template's order
    "<|channel|>commentary to=get_weather json<|message|>{}",  # a bare recipient is a function (vLLM's rule)
    "<|channel|>commentary to=math.sum json<|message|>{\"a\": 2}",
    "<|channel|>commentary to=functions.no_args json<|message|>",
    "<|channel|>commentary to=functions.not_json<|message|>foo",
    '<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|call|>'
    '<|start|>assistant to=functions.b<|channel|>commentary json<|message|>{"y": "Zürich"}',
    "<|channel|>commentary to=assistant<|message|>Tool says<|end|><|start|>assistant<|channel|>final<|message|>Hi",
    "<|channel|>analysis<|message|>About the weather.<|end|><|start|>assistant" + CALL + '{"city": "Oslo"}',
    "<|channel|>commentary<|message|>Let me look that up.<|end|><|start|>assistant<|channel|>final<|message|>42.",
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + CALL + '{"city": "SF"}',
    '<|channel|>commentary to=browser.search json<|message|>{"query": "x"}',  # a built-in tool's: dropped
    '<|channel|>final <|constrain|>json<|message|>{"result":true}',
    "<|channel|>analysis<|message|>日本語 🎉<|end|><|start|>assistant<|channel|>final<|message|>é\n\n",
    "<|channel|>analysis<|message|>One<|end|><|start|>assistant<|channel|>analysis<|message|>Two<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Three",
]


@pytest.mark.parametrize("text", REPLIES)
def test_replies_read_as_openai_harmony_reads_them(encoding, text):
    expected = reference(encoding, text)
    assert parsed(text) == expected
    for size in PIECES:
        assert parsed(text, size) == expected, size
    for stop in ("<|return|>", "<|call|>"):  # include_stop_str_in_output: the same reading
        assert parsed(text + stop) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("Hello there", {"reasoning": None, "content": "Hello there", "calls": []}),  # not harmony: content
    ('{"city": "Paris"}', {"reasoning": None, "content": '{"city": "Paris"}', "calls": []}),
    # vLLM's malformed case: a header without <|message|> is content from its message on, as written
    ("<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>commentary<|message|>thinking"
     '<|end|><|start|>assistant<|channel|>final {"answer": "hi"}',
     {"reasoning": "thinking", "content": 'thinking\n<|start|>assistant<|channel|>final {"answer": "hi"}',
      "calls": []}),
    ("<|channel|>final<|message|>Hi<|end|>junk", {"reasoning": None, "content": "Hi\njunk", "calls": []}),
    ("", {"reasoning": None, "content": None, "calls": []}),
])
def test_what_is_not_harmony_is_content_once_the_reply_ends(text, expected):
    assert parsed(text) == expected
    for size in PIECES:
        assert parsed(text, size) == expected, size


def test_only_a_finished_call_streams_and_nothing_is_sent_twice():
    parser = ChoiceParser(ToolPlan("auto", fmt=FORMAT), HarmonyReasoning())
    assert parser.feed("<|channel|>analysis<|message|>Need it<|e", final=False) == {"reasoning_content": "Need it"}
    assert parser.feed("nd|><|start|>assistant" + CALL + '{"city": "Paris"', final=False) == {}
    delta = parser.feed("}", final=True)
    assert [c["function"] for c in delta["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert parser.finish_reason("stop") == "tool_calls"
    none = ChoiceParser(ToolPlan("none", fmt=FORMAT), None)  # tool_choice none: calls dropped, no reasoning
    assert none.feed("<|channel|>analysis<|message|>x<|end|><|start|>assistant" + CALL + "{}", final=True) == {}


def test_required_grammar_is_one_harmony_call_to_a_tool():
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = Grammar.from_ebnf(call_grammar([("get_weather", WEATHER), ("get_time", TIME)]).grammar)
    assert _is_grammar_accept_string(grammar, CALL + '{"city": "Paris"}')
    assert _is_grammar_accept_string(grammar, CALL.replace("get_weather", "get_time") + '{"zone": "CET"}')
    for text in (CALL + '{"city": "Oslo"}', CALL + "{}", CALL.replace("get_weather", "nope") + "{}",
                 "<|channel|>analysis<|message|>x", '{"city": "Paris"}'):
        assert not _is_grammar_accept_string(grammar, text), text


# The served model: the gpt-oss family's test shape with gpt-oss's own tokenizer and template
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
MODEL = "gpt-oss-tiny"
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
THINK = '"<|channel|>analysis<|message|>" [a-z ]{3,12} "<|end|><|start|>assistant"'
REASONING_REPLY = {"grammar": f'root ::= {THINK} "<|channel|>final<|message|>" [A-Z] [a-z ]{{3,12}}'}
CALL_REPLY = {"grammar": f'root ::= {THINK} {json.dumps(CALL)} "{{\\"city\\": \\"" ("Paris" | "Rome") "\\"}}"'}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The gpt-oss family's test model (conftest's shape and weights) with gpt-oss's tokenizer files
    copied beside it (loading and saving them again costs seconds) and the hub's EOS ids."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("gpt-oss")
    spec = {**_SMALL, **FAMILY_CONFIGS["gpt_oss"], "max_position_embeddings": 512}
    del spec["tokenizer"]
    ids = {"bos_token_id": 199998, "eos_token_id": EOS_IDS, "pad_token_id": 199999}
    config = AutoConfig.for_model(**spec, vocab_size=VOCAB_SIZE, **ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(peaked_init(name, param))
    model.generation_config.update(**ids)
    model.to(getattr(torch, TEST_DTYPE)).save_pretrained(str(folder))
    for file in Path(real_tokenizer_path("o200k_harmony")).iterdir():
        shutil.copy(file, folder)
    return str(folder)


@pytest.fixture(scope="module")
def server(model_path):
    flags = ["--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "openai",
             "--reasoning-parser", "openai_gptoss", "--max-model-len", "512"]
    with running_server(*flags, model=model_path) as (base, _):
        yield base


def ask(client, messages=ASK, stream=False, **extra):
    fields = {k: extra.pop(k) for k in ("tool_choice", "reasoning_effort") if k in extra}
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=extra.pop("max_tokens", 120), temperature=0,
        logprobs=True, stream=stream, extra_body={"return_token_ids": True, **extra}, **fields)


def merged_stream(stream) -> dict:
    out = {"content": "", "reasoning": "", "calls": [], "finish_reason": None, "token_ids": [], "logprobs": [],
           "raw_text": ""}
    for chunk in stream:
        for choice in chunk.choices:
            delta, extra = choice.delta, choice.model_extra or {}
            out["content"] += delta.content or ""
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            out["calls"] += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
            out["token_ids"] += extra.get("token_ids") or []
            out["raw_text"] += extra.get("raw_text") or ""
            if choice.logprobs is not None:
                out["logprobs"] += [entry.logprob for entry in choice.logprobs.content]
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def scored(server, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """/v1/completions' logprobs of the completion's ids after the prompt's."""
    body = {"model": MODEL, "prompt": prompt_ids + completion_ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    response = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"][len(prompt_ids):]


def harmony_prompt(encoding, effort: str, history: list) -> list[int]:
    """openai-harmony's rendering of ASK (today's date, as the template's strftime_now) with TOOLS, then
    `history`, for the assistant's next message."""
    system = (harmony.SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
              .with_reasoning_effort(harmony.ReasoningEffort(effort.capitalize())))
    tools = [harmony.ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                         parameters=t["function"]["parameters"]) for t in TOOLS]
    developer = harmony.DeveloperContent.new().with_instructions("Be brief.").with_function_tools(tools)
    messages = [harmony.Message.from_role_and_content(harmony.Role.SYSTEM, system),
                harmony.Message.from_role_and_content(harmony.Role.DEVELOPER, developer),
                harmony.Message.from_role_and_content(harmony.Role.USER, ASK[1]["content"]), *history]
    conversation = harmony.Conversation.from_messages(messages)
    return encoding.render_conversation_for_completion(conversation, harmony.Role.ASSISTANT)


def test_prompt_ids_are_the_templates_and_openai_harmonys(client, encoding, model_path):
    """The template's text (transformers' renderer, as apply_chat_template) in openai-harmony's tokens."""
    from transformers.utils.chat_template_utils import render_jinja_template

    answer = ask(client, max_tokens=1, reasoning_effort="high")
    prompt_ids = answer.model_extra["prompt_token_ids"]
    template = (Path(model_path) / "chat_template.jinja").read_text()
    [text], _ = render_jinja_template(conversations=[ASK], tools=TOOLS, chat_template=template,
                                      add_generation_prompt=True, reasoning_effort="high")
    assert "Reasoning: high" in text and prompt_ids == encoding.encode(text, allowed_special="all")
    assert prompt_ids == harmony_prompt(encoding, "high", [])
    # a call in the history, its reasoning (as the client hands the message back) and the tool's answer
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "assistant", "content": "", "reasoning_content": "Need the weather.", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    answer = ask(client, [*ASK, *history], max_tokens=1)
    assistant = harmony.Role.ASSISTANT
    expected = harmony_prompt(encoding, "medium", [
        harmony.Message.from_role_and_content(assistant, "Need the weather.").with_channel("analysis"),
        harmony.Message.from_role_and_content(assistant, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("json"),  # the template writes `json`
        harmony.Message.from_author_and_content(harmony.Author.new(harmony.Role.TOOL, "functions.get_weather"),
                                                json.dumps('{"sky": "clear"}'))
        .with_channel("commentary").with_recipient("assistant"),
    ])
    assert answer.model_extra["prompt_token_ids"] == expected


@pytest.mark.parametrize("grammar", [REASONING_REPLY, CALL_REPLY], ids=["reasoning", "call"])
def test_a_reply_streamed_and_whole_as_openai_harmony_reads_it(server, client, encoding, grammar):
    whole = ask(client, structured_outputs=grammar)
    choice = whole.choices[0]
    raw = choice.model_extra["raw_text"]
    expected = reference(encoding, raw)
    message = choice.message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert (message.model_extra["reasoning_content"], message.content, calls) == (
        expected["reasoning"], expected["content"], expected["calls"])
    assert expected["reasoning"] and (expected["calls"] if grammar is CALL_REPLY else expected["content"])
    assert choice.finish_reason == ("tool_calls" if grammar is CALL_REPLY else "stop")
    ids = choice.model_extra["token_ids"]
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    assert logprobs == scored(server, whole.model_extra["prompt_token_ids"], ids)
    streamed = merged_stream(ask(client, stream=True, structured_outputs=grammar))
    assert (streamed["reasoning"], streamed["content"] or None, streamed["calls"]) == (
        expected["reasoning"], expected["content"], expected["calls"])
    assert (streamed["token_ids"], streamed["logprobs"], streamed["raw_text"]) == (ids, logprobs, raw)
    assert streamed["finish_reason"] == choice.finish_reason
    if grammar is CALL_REPLY:  # /v1/responses' items from the same message: reasoning, then the call
        shape = ResponseShape(ResponsesRequest(input="x"), "resp-1", MODEL)
        output = shape.response(choice.model_dump(), whole.usage.model_dump())["output"]
        assert [(item["type"], item.get("name")) for item in output] == [("reasoning", None), ("function_call", "get_weather")]
        assert output[0]["content"][0]["text"] == expected["reasoning"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_are_one_harmony_call(server, client, tool_choice):
    whole = ask(client, tool_choice=tool_choice)
    choice = whole.choices[0]
    [call] = choice.message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert choice.model_extra["raw_text"].startswith("<|channel|>commentary to=functions." + call.function.name)
    assert choice.message.content == "" and choice.message.model_extra["reasoning_content"] is None
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    if tool_choice != "required":
        assert call.function.name == "get_time"
    streamed = merged_stream(ask(client, stream=True, tool_choice=tool_choice))
    assert streamed["calls"] == [(call.function.name, call.function.arguments)]
    assert streamed["token_ids"] == choice.model_extra["token_ids"]
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    assert logprobs == scored(server, whole.model_extra["prompt_token_ids"], choice.model_extra["token_ids"])


def test_responses_api_a_call_with_an_effort(client):
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    kwargs = dict(model=MODEL, input="What is the weather in Paris?", tools=flat, tool_choice="required",
                  reasoning={"effort": "low"}, max_output_tokens=60, temperature=0)
    first = client.responses.create(**kwargs)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and call.name in ("get_weather", "get_time")
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [(call.name, call.arguments)]


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"reasoning_effort": "minimal"}, "reasoning_effort", "not one of harmony's efforts"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "reasoning_effort", "set one"),
    ({"chat_template_kwargs": {"builtin_tools": ["browser"]}}, "chat_template_kwargs", "built-in browser and python"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}], "tool_choice": "required"}, "tools",
     "harmony header"),
])
def test_what_is_not_built_is_refused_by_name(server, extra, param, words):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1, **extra}
    response = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_an_effort_needs_a_server_that_reads_harmony():
    from types import SimpleNamespace

    from coreserve.frontend.server.common.errors import APIError
    from coreserve.frontend.server.openai.harmony_fields import check_reasoning_effort

    with pytest.raises(APIError, match="needs a server that reads harmony") as info:
        check_reasoning_effort(SimpleNamespace(reasoning_parser="qwen3", tool_call_parser="hermes"), "low", "reasoning")
    assert info.value.param == "reasoning"
    check_reasoning_effort(SimpleNamespace(reasoning_parser=None, tool_call_parser="openai"), "low", "reasoning")


def test_harmony_parsers_go_together_at_start():
    """Harmony is read whole: the reasoning parser of one format and the calls of another are refused."""
    done = subprocess.run([sys.executable, "-m", "coreserve", "serve", "builtin:tiny", "--reasoning-parser",
                           "openai_gptoss", "--tool-call-parser", "hermes"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "--reasoning-parser openai_gptoss goes with --tool-call-parser openai" in done.stderr
