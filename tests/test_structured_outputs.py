"""Structured outputs through LLM on the real SmolLM2 (builtin:smollm2): every output follows its JSON
schema, regex, choice or grammar; logprobs under a constraint both ways (processed: the masked,
renormalised distribution; raw: the model's own, bit for bit an unconstrained run's) and the mass the
grammar allowed; unconstrained rows in a mixed batch keep their numbers; bad grammars are ValueErrors.
Cases adapted from the kinds vLLM's structured-output tests exercise (schemas, an IPv4 regex, a
language choice, a SQL grammar). docs/structured_outputs.md.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from coreserve import LLM, SamplingParams
from coreserve.protocol.builtin_model import builtin_model_path
from coreserve.protocol.structured_outputs import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["name", "age", "skills"],
    "additionalProperties": False,
}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["x", "ok"],
    "additionalProperties": False,
}
IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
LANGUAGES = ["Python", "Java", "JavaScript", "C++", "Rust"]
CAPITALS = ["Paris", "London", "Berlin"]
SQL = """root ::= "SELECT " column " FROM " table " WHERE " column " = " number
column ::= "id" | "name" | "age"
table ::= "users" | "orders"
number ::= [1-9] [0-9]?"""
SQL_RE = r"SELECT (id|name|age) FROM (users|orders) WHERE (id|name|age) = [1-9][0-9]?"
CAPITAL_PROMPT = "Q: What is the capital of France?\nA:"


def so(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, **fields)


@pytest.fixture(scope="module")
def llm():
    with LLM(builtin_model_path("smollm2"), multiprocess=False, num_threads=1, max_num_seqs=16) as llm:
        yield llm


def test_outputs_follow_their_schema_regex_choice_and_grammar(llm):
    requests = [
        ("A person as JSON:", greedy(max_tokens=60, structured_outputs=so(json=PERSON))),
        ("A point as JSON:", greedy(max_tokens=20, structured_outputs=so(json=json.dumps(POINT)))),
        ("The IP address of the server is", greedy(max_tokens=20, structured_outputs=so(regex=IPV4))),
        ("My favourite programming language is", greedy(max_tokens=8, structured_outputs=so(choice=LANGUAGES))),
        ("A SQL query:", greedy(max_tokens=24, structured_outputs=so(grammar=SQL))),
    ]
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    person, point, ip, language, sql = (o.outputs[0] for o in outputs)
    for completion in (person, point, ip, language, sql):
        assert completion.finish_reason == "stop", completion  # the grammar ended it, within max_tokens
    jsonschema.validate(json.loads(person.text), PERSON)
    jsonschema.validate(json.loads(point.text), POINT)
    assert re.fullmatch(IPV4, ip.text), ip.text
    assert language.text in LANGUAGES
    assert re.fullmatch(SQL_RE, sql.text), sql.text


def test_sampled_outputs_with_n_follow_the_choice_and_the_json_object_mode(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, structured_outputs=so(choice=LANGUAGES))
    out = llm.generate("I like to program in", params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(c.text in LANGUAGES for c in out.outputs)
    obj = llm.generate(
        'Write {"a": 1} as JSON:', greedy(max_tokens=30, structured_outputs=so(json_object=True)), use_tqdm=False
    )[0].outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # cut at max_tokens: still a JSON object's beginning
        assert obj.text.lstrip().startswith("{")


def _values(position: dict) -> dict[int, float]:
    return {token_id: lp.logprob for token_id, lp in position.items()}


def test_processed_logprobs_are_the_masked_distribution_and_raw_ones_the_models_own(llm):
    choice = so(choice=CAPITALS)
    processed, raw, free = llm.generate(
        [CAPITAL_PROMPT] * 3,
        [
            greedy(max_tokens=6, logprobs=20, structured_outputs=choice, logprobs_mode="processed_logprobs"),
            greedy(max_tokens=6, logprobs=20, structured_outputs=choice, logprobs_mode="raw_logprobs"),
            greedy(max_tokens=1, logprobs=20, logprobs_mode="raw_logprobs"),
        ],
        use_tqdm=False,
    )
    processed, raw, free = processed.outputs[0], raw.outputs[0], free.outputs[0]
    assert processed.text in CAPITALS and raw.text == processed.text
    first = processed.logprobs[0]
    # fewer than 20 first tokens are allowed (prefixes of the three names): all of them, none at -inf
    assert len(first) < 21 and all(math.isfinite(v) for v in _values(first).values())
    assert sum(math.exp(v) for v in _values(first).values()) == pytest.approx(1.0, abs=1e-5)
    assert all(math.isfinite(lp.logprob) for entry in processed.logprobs for lp in entry.values())
    # raw: the first position's top-20 is the unconstrained run's, bit for bit
    top = {t: lp.logprob for t, lp in raw.logprobs[0].items() if lp.rank <= 20}
    assert top == {t: lp.logprob for t, lp in free.logprobs[0].items() if lp.rank <= 20}
    chosen = raw.token_ids[0]
    if chosen in free.logprobs[0]:
        assert raw.logprobs[0][chosen].logprob == free.logprobs[0][chosen].logprob
    # greedy, nothing else processed: processed = raw - log(mass the grammar allowed), token by token
    assert processed.constraint_masses == raw.constraint_masses and len(raw.constraint_masses) == len(raw.token_ids)
    for token_id, p_entry, r_entry, mass in zip(
        raw.token_ids, processed.logprobs, raw.logprobs, raw.constraint_masses
    ):
        assert 0.0 < mass <= 1.0
        assert p_entry[token_id].logprob == pytest.approx(r_entry[token_id].logprob - math.log(mass), abs=1e-4)
    assert free.constraint_masses is None


def test_an_unconstrained_request_in_a_mixed_batch_keeps_its_numbers_exactly(llm):
    plain = greedy(max_tokens=8, logprobs=5)
    alone = llm.generate("The three primary colours are", plain, use_tqdm=False)[0].outputs[0]
    mixed = llm.generate(
        ["A point as JSON:", "The three primary colours are", "The IP address is"],
        [
            greedy(max_tokens=8, logprobs=5, structured_outputs=so(json=POINT)),
            plain,
            greedy(max_tokens=8, structured_outputs=so(regex=IPV4)),
        ],
        use_tqdm=False,
    )[1].outputs[0]
    assert mixed.token_ids == alone.token_ids
    assert [_values(p) for p in mixed.logprobs] == [_values(p) for p in alone.logprobs]
    assert mixed.cumulative_logprob == alone.cumulative_logprob


def test_a_bad_grammar_is_a_value_error_and_the_engine_keeps_serving(llm):
    bad = [
        (so(json={"type": "no-such-type"}), "structured_outputs.json"),
        (so(json="{not json"), "structured_outputs.json"),
        (so(regex="(unclosed"), "structured_outputs.regex"),
        (so(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
    ]
    for params, name in bad:
        with pytest.raises(ValueError, match=re.escape(name)):
            llm.generate("Hi", greedy(max_tokens=2, structured_outputs=params), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        so(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=so(choice=["a"]))
    out = llm.generate("A point as JSON:", greedy(max_tokens=20, structured_outputs=so(json=POINT)), use_tqdm=False)
    jsonschema.validate(json.loads(out[0].outputs[0].text), POINT)


def test_prefix_cache_hits_and_multi_step_windows_leave_constrained_outputs_unchanged(llm):
    prompt = "Here is a long shared preamble about points on a plane, repeated. " * 3 + "A point as JSON:"
    params = greedy(max_tokens=20, logprobs=2, structured_outputs=so(json=POINT))
    first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].constraint_masses == first.outputs[0].constraint_masses
    path = builtin_model_path("smollm2")
    with LLM(path, multiprocess=False, num_threads=1, num_scheduler_steps=4) as windowed:
        again = windowed.generate(
            [prompt, "The three primary colours are"], [params, greedy(max_tokens=8)], use_tqdm=False
        )
    plain = llm.generate("The three primary colours are", greedy(max_tokens=8), use_tqdm=False)[0]
    assert again[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert again[1].outputs[0].token_ids == plain.outputs[0].token_ids
