"""vLLM's server tests for structured outputs on completions and chat, adapted to coreserve: one real
`python -m coreserve serve` of SmolLM2-135M-Instruct (builtin:smollm2) on loopback, driven by the openai
client. Each test names the vLLM test it adapts (under vLLM's tests/entrypoints/openai/). The requests
are theirs (the employee schema, the IPv4 regex, the language choices, the SQL grammar, the invalid
schema, regex and grammar, the {"result": 2} prompts); every JSON output parses and validates
(`jsonschema`), every choice output is one of the choices, every regex output matches in full. What
vLLM asks for that coreserve refuses by design (a per-request backend, a Lark grammar, a whitespace
pattern, a structural tag) is asserted as the 400 naming the field. docs/structured_outputs.md.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_harness import running_server

from coreserve.protocol.builtin_model import builtin_model_path

MODEL = "smollm2"
# vLLM's sample schema (an employee profile), bounded (string lengths, array sizes) to close in few tokens
EMPLOYEE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3,
                   "maxItems": 3},
        "work_history": {"type": "array", "maxItems": 1, "items": {
            "type": "object",
            "properties": {"company": {"type": "string", "maxLength": 12},
                           "duration": {"type": "number", "minimum": 0, "maximum": 50},
                           "position": {"type": "string", "maxLength": 12}},
            "required": ["company", "position"],
            "additionalProperties": False,
        }},
    },
    "required": ["name", "age", "skills", "work_history"],
    "additionalProperties": False,
}
EMPLOYEE_PROMPT = f"Give an example JSON for an employee profile that fits this schema: {EMPLOYEE}"
IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
LANGUAGES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
LANGUAGE_PROMPT = "The best language for type-safe systems programming is "
SQL_LARK = """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""
SQL_EBNF = re.sub(r"^(\w+):", r"\1 ::=", SQL_LARK.replace("start:", "root:"), flags=re.M)  # the same
SQL_SENTENCE = r"SELECTcol_[12]fromtable_[12]wherecol_[12]=[12]"  # every sentence of SQL_EBNF
SQL_PROMPT = "Generate a sql state that select col_1 from table_1 where it is equals to 1"
BAD_SCHEMA = {  # a property whose schema is a string
    "$defs": {"CarType": {"enum": ["sedan", "SUV", "Truck", "Coupe"], "title": "CarType", "type": "string"}},
    "properties": {"brand": {"type": "string"}, "model": {"type": "string"},
                   "car_type": {"$ref": "#/$defs/CarType"}, "foo": "bar"},
    "required": ["brand", "model", "car_type"],
    "type": "object",
}
BAD_GRAMMAR = 'root ::= select_statementinvalidsyntax\nselect_statement ::= "SELECT " "col_1 "'
SYSTEM = {"role": "system", "content": "you are a helpful assistant"}


@pytest.fixture(scope="module")
def base():
    # the Q4_1 GGUF file, the same in either test dtype
    with running_server("--served-model-name", MODEL, model=builtin_model_path("smollm2")) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, prompt: str, extra: dict, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kwargs)


def chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def refused(client: openai.OpenAI, field: str, chat_fields: dict | None = None, **completion_fields) -> None:
    """A short chat or completion with these fields is a 400 naming `field`; the server still serves."""
    with pytest.raises(openai.BadRequestError) as info:
        if chat_fields is not None:
            chat(client, [SYSTEM, {"role": "user", "content": "Hi"}], max_tokens=5, extra_body=chat_fields)
        else:
            complete(client, "Give an example", completion_fields, max_tokens=5)
    body = info.value.body if isinstance(info.value.body, dict) else {}
    error = body.get("error", body)
    assert error.get("param") == field or field in str(error.get("message")), error
    after = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
    assert after.choices[0].finish_reason in ("length", "stop")


def valid_json(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(instance=value, schema=schema)
    return value


# ---- completions: vLLM's test_completion.py (tests/entrypoints/openai/, completion/ in later trees) ----


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_json_completion_n3(client, field):
    """Adapts test_completion.py::test_guided_json_completion: n=3 at temperature 1 under the employee
    schema, as guided_json and as structured_outputs.json; all three parse and validate."""
    extra = {field: EMPLOYEE} if field == "guided_json" else {field: {"json": EMPLOYEE}}
    completion = complete(client, EMPLOYEE_PROMPT, extra, n=3, temperature=1.0, seed=7, max_tokens=120)
    assert completion.id and len(completion.choices) == 3
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice
        valid_json(choice.text, EMPLOYEE)


def test_choice_completion_n2(client):
    """Adapts test_completion.py::test_guided_choice_completion: n=2, temperature 1, the languages."""
    extra = {"guided_choice": LANGUAGES}
    completion = complete(client, LANGUAGE_PROMPT, extra, n=2, temperature=1.0, seed=7, max_tokens=10)
    assert len(completion.choices) == 2
    assert all(choice.text in LANGUAGES and choice.finish_reason == "stop" for choice in completion.choices)


def test_choice_completion_batch_and_stream(client):
    """Adapts test_completion.py::test_guided_choice_completion to test_batch_completions' shapes: a list
    of two prompts, streamed and not, then with n=2 (four choices); every text (streamed: joined per
    index) is a choice, and at temperature 0 the two copies of a prompt agree, streamed or not."""
    prompts, extra = [LANGUAGE_PROMPT] * 2, {"guided_choice": LANGUAGES}
    batch = complete(client, prompts, extra, max_tokens=10, temperature=0)
    assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text in LANGUAGES
    texts = ["", ""]
    for chunk in complete(client, prompts, extra, max_tokens=10, temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [batch.choices[0].text] * 2
    batch = complete(client, prompts, extra, n=2, max_tokens=10, temperature=1.0, seed=3)
    assert len(batch.choices) == 4 and all(choice.text in LANGUAGES for choice in batch.choices)


def test_regex_completion_n3(client):
    """Adapts test_completion.py::test_guided_regex_completion: n=3, temperature 1, the IPv4 regex,
    max_tokens 20, every output matching in full; then streamed as in test_parallel_streaming, as
    structured_outputs.regex: each index's joined text matches and has one finish_reason."""
    prompt = f"Give an example IPv4 address with this regex: {IPV4}"
    completion = complete(client, prompt, {"guided_regex": IPV4}, n=3, temperature=1.0, seed=7, max_tokens=20)
    assert len(completion.choices) == 3
    assert all(re.fullmatch(IPV4, choice.text) for choice in completion.choices), completion.choices
    texts, finished, extra = ["", "", ""], [0, 0, 0], {"structured_outputs": {"regex": IPV4}}
    for chunk in complete(client, prompt, extra, n=3, temperature=1.0, seed=11, max_tokens=20, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] += choice.finish_reason is not None
    assert finished == [1, 1, 1]
    assert all(re.fullmatch(IPV4, text) for text in texts), texts


def test_grammar_completion(client):
    """Adapts test_completion.py::test_guided_grammar: vLLM's SQL grammar in Lark is refused (xgrammar's
    EBNF only: a 400 naming guided_grammar); the same grammar in EBNF gives a sentence of it at
    temperature 1, and greedily vLLM's ground truth (the query asked for, spaces removed)."""
    refused(client, "guided_grammar", guided_grammar=SQL_LARK)
    extra = {"guided_grammar": SQL_EBNF}
    completion = complete(client, SQL_PROMPT, extra, temperature=1.0, seed=5, max_tokens=30)
    assert completion.choices[0].finish_reason == "stop"
    assert re.fullmatch(SQL_SENTENCE, completion.choices[0].text.strip()), completion.choices[0].text
    completion = complete(client, SQL_PROMPT, extra, temperature=0, max_tokens=30)
    assert completion.choices[0].text.strip() == "SELECTcol_1fromtable_1wherecol_1=1"


def test_completion_type_errors(client):
    """Adapts test_completion.py::test_guided_decoding_type_error: guided_json=42 is a 400, and so is
    guided_regex with guided_json (named: the second of the two); the per-request
    guided_decoding_backend that vLLM's older tests pass is refused by name."""
    refused(client, "guided_json", guided_json=42)
    refused(client, "guided_regex", guided_regex=IPV4, guided_json=EMPLOYEE)
    for backend in ("outlines", "lm-format-enforcer", "xgrammar"):
        refused(client, "guided_decoding_backend", guided_json=EMPLOYEE, guided_decoding_backend=backend)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_invalid_schema_regex_grammar(client, route):
    """Adapts completion/test_completion.py::test_invalid_json_schema, ::test_invalid_regex and
    ::test_invalid_grammar (structured_outputs on completions) and tests/v1/entrypoints/openai/
    test_chat_completion.py's three of the same names (guided_* on chat): each a 400 naming the field."""
    for kind, value in [("json", BAD_SCHEMA), ("regex", r"[.*"), ("grammar", BAD_GRAMMAR)]:
        if route == "completions":
            refused(client, "structured_outputs", structured_outputs={kind: value}, stop=["\n"])
        else:
            refused(client, f"guided_{kind}", {f"guided_{kind}": value, "stop": ["\n"]})


def test_refused_fields(client):
    """vLLM's fields that coreserve refuses by design, each a 400 naming it: guided_whitespace_pattern
    (vLLM's whitespace-pattern cases of test_guided_json_completion), structural_tag and a
    response_format of type structural_tag (vLLM's structural-tag tests)."""
    whitespace = {"guided_json": EMPLOYEE, "guided_whitespace_pattern": r"[\n ]*"}
    refused(client, "guided_whitespace_pattern", whitespace)
    refused(client, "structural_tag", {"structural_tag": '{"type": "structural_tag"}'})
    refused(client, "response_format", {"response_format": {"type": "structural_tag", "format": {}}})


# ---- chat: vLLM's chat_completion/test_chat.py (tests/entrypoints/openai/test_chat.py in older trees) ----


def two_turns(client: openai.OpenAI, first: str, again: str, max_tokens: int, extra: dict) -> list[str]:
    """The answer to `first`, then to `again` after it (temperature 0.7): vLLM's two-turn chat tests."""
    messages = [SYSTEM, {"role": "user", "content": first}]
    answers = []
    for turn in range(2):
        result = chat(client, messages, max_completion_tokens=max_tokens, temperature=0.7, seed=turn,
                      extra_body=extra)
        assert result.choices[0].finish_reason == "stop", result
        answers.append(result.choices[0].message.content)
        messages += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": again}]
    return answers


def test_choice_chat(client):
    """Adapts test_chat.py::test_structured_outputs_choice_chat: two turns, each answer a language, the
    second another one."""
    extra = {"structured_outputs": {"choice": LANGUAGES}}
    answers = two_turns(client, LANGUAGE_PROMPT, "I disagree, pick another one", 10, extra)
    assert all(answer in LANGUAGES for answer in answers) and answers[0] != answers[1], answers


def test_json_chat(client):
    """Adapts test_chat.py::test_structured_outputs_json_chat: two turns under the employee schema, both
    validate, with another name and age the second time."""
    again = "Give me another one with a different name and age"
    answers = two_turns(client, EMPLOYEE_PROMPT, again, 120, {"structured_outputs": {"json": EMPLOYEE}})
    first, second = (valid_json(answer, EMPLOYEE) for answer in answers)
    assert first["name"] != second["name"] and first["age"] != second["age"]


def test_regex_chat(client):
    """Adapts test_chat.py::test_structured_outputs_regex_chat: two turns under the IPv4 regex, both
    match (vLLM also wants two different addresses; SmolLM2 repeats its first, so that is left out)."""
    first = f"Give an example IP address with this regex: {IPV4}"
    answers = two_turns(client, first, "Give me a different one", 20, {"structured_outputs": {"regex": IPV4}})
    assert all(re.fullmatch(IPV4, answer) for answer in answers), answers


def test_json_chat_streaming_and_n(client):
    """Adapts test_chat.py::test_structured_outputs_json_chat with test_chat_streaming (at temperature 0
    the streamed text is the unstreamed one, with one finish_reason) and
    test_chat_completion_n_parameter_streaming (n=2 streamed: each index's text validates)."""
    messages = [SYSTEM, {"role": "user", "content": "Give an example JSON for an employee profile."}]
    kwargs = {"max_completion_tokens": 120, "extra_body": {"structured_outputs": {"json": EMPLOYEE}}}
    whole = chat(client, messages, temperature=0, **kwargs).choices[0].message.content
    valid_json(whole, EMPLOYEE)
    parts, reasons = [], []
    for chunk in chat(client, messages, temperature=0, stream=True, **kwargs):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert "".join(parts) == whole and reasons == ["stop"]
    texts = ["", ""]
    for chunk in chat(client, messages, temperature=0.7, seed=1, n=2, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    for text in texts:
        valid_json(text, EMPLOYEE)


def test_chat_type_errors(client):
    """Adapts test_chat.py::test_structured_outputs_type_error (structured_outputs.regex an object) and
    the older test_chat.py::test_guided_decoding_type_error_chat (guided_regex an object; guided_regex
    with guided_json): 400s naming the field."""
    refused(client, "structured_outputs", {"structured_outputs": {"regex": {1: "Python", 2: "C++"}}})
    refused(client, "guided_regex", {"guided_regex": {1: "Python", 2: "C++"}})
    refused(client, "guided_regex", {"guided_regex": IPV4, "guided_json": EMPLOYEE})


def test_choice_chat_logprobs(client):
    """Adapts test_chat.py::test_structured_outputs_choice_chat_logprobs: top_logprobs=5 under the
    choice; every listed logprob, of every token (vLLM looks at the first), is above -9999 (no
    sentinels), and at most 0."""
    messages = [SYSTEM, {"role": "user", "content": LANGUAGE_PROMPT}]
    result = chat(client, messages, max_completion_tokens=10, logprobs=True, top_logprobs=5,
                  extra_body={"structured_outputs": {"choice": LANGUAGES}})
    choice = result.choices[0]
    assert choice.message.content in LANGUAGES
    assert choice.logprobs is not None and choice.logprobs.content
    for entry in choice.logprobs.content:
        assert -9999.0 < entry.logprob <= 0.0
        assert entry.top_logprobs and all(-9999.0 < top.logprob <= 0.0 for top in entry.top_logprobs), entry


def test_response_format_json_object(client):
    """Adapts test_chat.py::test_response_format_json_object: twice, the answer is the JSON object
    {"result": 2} (greedy here; vLLM samples)."""
    prompt = 'what is 1+1? please respond with a JSON object, the format is {"result": 2}'
    for _ in range(2):
        result = chat(client, [{"role": "user", "content": prompt}], max_completion_tokens=30, temperature=0,
                      response_format={"type": "json_object"})
        assert result.choices[0].finish_reason == "stop"
        assert json.loads(result.choices[0].message.content) == {"result": 2}


def test_response_format_json_schema(client):
    """Adapts test_chat.py::test_response_format_json_schema: unconstrained, the answer to the prompt is
    not the JSON {"result": 2}; with the schema {result: integer} it is, twice (greedy here)."""
    prompt = [{"role": "user", "content": 'what is 1+1? The format is "result": 2'}]
    free = chat(client, prompt, max_completion_tokens=30, temperature=0).choices[0].message.content
    with pytest.raises((json.JSONDecodeError, AssertionError)):
        assert json.loads(free) == {"result": 2}
    schema = {"type": "object", "properties": {"result": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "foo_test", "schema": schema}}
    for _ in range(2):
        result = chat(client, prompt, max_completion_tokens=20, temperature=0, response_format=fmt)
        assert result.choices[0].finish_reason == "stop"
        assert valid_json(result.choices[0].message.content, schema) == {"result": 2}


def test_response_format_text(client):
    """Adapts test_chat.py::test_response_format_text: type text changes nothing (twice, greedy)."""
    messages, text_format = [{"role": "user", "content": "what is 1+1?"}], {"type": "text"}
    free = chat(client, messages, max_completion_tokens=10, temperature=0).choices[0].message.content
    for _ in range(2):
        text = chat(client, messages, max_completion_tokens=10, temperature=0, response_format=text_format)
        assert text.choices[0].message.content == free and free
