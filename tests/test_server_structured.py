"""Structured outputs through a real `coreserve serve` of SmolLM2 (builtin:smollm2), driven by the openai
client: response_format (json_object, json_schema with strict) and vLLM's structured_outputs on chat
and completions, the legacy guided_* fields, logprobs with constraint_mass and no sentinels, streaming
and n > 1 under a grammar, a bad schema a 400 after which the server keeps serving. Cases adapted from
the kinds vLLM's server tests for structured outputs use. docs/structured_outputs.md.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_harness import MODEL as TINY
from server_harness import latencies_while, running_server

from coreserve.protocol.builtin_model import builtin_model_path

MODEL = "smollm2"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLOURS = ["red", "green", "blue"]
DATE = r"20\d\d-(0[1-9]|1[0-2])-[0-2]\d"
YES_NO = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def base():
    # the Q4_1 GGUF file, the same in either test dtype
    with running_server("--served-model-name", MODEL, model=builtin_model_path("smollm2")) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_json_schema_strict_and_json_object_give_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    result = client.chat.completions.create(
        model=MODEL, messages=user("Invent a person."), max_tokens=40, temperature=0, response_format=fmt
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    result = client.chat.completions.create(
        model=MODEL,
        messages=user('Reply with the JSON object {"ok": true} only.'),
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = result.choices[0].message.content
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


def test_completions_take_structured_outputs_response_format_and_the_guided_fields(client):
    def complete(prompt: str, **extra) -> str:
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra
        )
        assert result.choices[0].finish_reason == "stop", result
        return result.choices[0].text

    assert complete("My favourite colour is", structured_outputs={"choice": COLOURS}) in COLOURS
    assert complete("My favourite colour is", guided_choice=COLOURS) in COLOURS
    assert re.fullmatch(DATE, complete("Today's date is", guided_regex=DATE))
    assert re.fullmatch(DATE, complete("Today's date is", structured_outputs={"regex": DATE}))
    assert complete("Is the sky blue? Answer:", guided_grammar=YES_NO) in ("yes", "no")
    jsonschema.validate(json.loads(complete("A person as JSON:", guided_json=PERSON)), PERSON)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    jsonschema.validate(json.loads(complete("A person as JSON:", response_format=fmt)), PERSON)


def test_chat_choice_logprobs_carry_constraint_mass_and_no_sentinels(client):
    result = client.chat.completions.create(
        model=MODEL,
        messages=user("Name a primary colour."),
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        extra_body={"structured_outputs": {"choice": COLOURS}},
    )
    choice = result.choices[0]
    assert choice.message.content in COLOURS
    raw = choice.model_dump()["logprobs"]["content"]
    assert raw and all(0.0 < entry["constraint_mass"] <= 1.0 for entry in raw)
    assert all(top["logprob"] > -9999.0 for entry in raw for top in entry["top_logprobs"])
    legacy = client.completions.create(
        model=MODEL, prompt="My favourite colour is", max_tokens=5, temperature=0, logprobs=5,
        extra_body={"guided_choice": COLOURS},
    )
    logprobs = legacy.choices[0].model_dump()["logprobs"]
    assert len(logprobs["constraint_mass"]) == len(logprobs["tokens"])
    assert all(0.0 < mass <= 1.0 for mass in logprobs["constraint_mass"])


def test_streaming_and_n_under_a_grammar(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user("Invent a person."),
        max_tokens=40,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)
    result = client.completions.create(
        model=MODEL, prompt="My favourite colour is", max_tokens=5, n=3, temperature=1.0, seed=3,
        extra_body={"guided_choice": COLOURS},
    )
    assert len(result.choices) == 3 and all(c.text in COLOURS for c in result.choices)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_a_bad_grammar_is_a_400_and_the_server_keeps_serving(base, extra, param):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and (error["param"] == param or param in error["message"]), error
    good = httpx.post(f"{base}/v1/completions", json={**body, **{k: None for k in extra}}, timeout=60)
    assert good.status_code == 200, good.text


def test_the_first_grammar_leaves_other_clients_served_meanwhile():
    """The first grammar of a fresh server imports xgrammar (1.4 s here): on a worker thread, so the
    requests beside it are answered at once (0.1-0.2 s at worst, the import holding the GIL in turns);
    on the event loop (before) one of them waited out the import (0.75 s and more)."""
    body = {"model": TINY, "prompt": "Today is ", "max_tokens": 10, "structured_outputs": {"regex": DATE}}
    with running_server() as (url, _), httpx.Client(base_url=url, timeout=120) as http:
        assert http.post("/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 1}).status_code == 200
        status, _, latencies = latencies_while(
            url, lambda: http.post("/v1/completions", json=body).status_code, probe="/v1/models"
        )
    assert status == 200 and len(latencies) >= 5  # the window covered the import and more
    assert max(latencies) < 0.4, latencies
