"""Checks a request's grammar before it leaves for the core (frontend process).

The schema, regex or EBNF grammar is parsed by xgrammar here, once per distinct text (cached), so a
bad one is a ValueError naming the problem (a 400 over HTTP) and never reaches the core. The core
compiles it again against the vocabulary (coreserve/engine_core/grammar_compiler.py). xgrammar (and with it torch)
is imported on the first grammar only. docs/structured_outputs.md.
"""

from __future__ import annotations

import functools

from coreserve.protocol.structured_outputs import StructuredOutputsParams, choice_grammar, grammar_error

MAX_CHECKED = 1024  # distinct grammars whose check is remembered


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """ValueError naming the field and xgrammar's reason when the grammar does not parse."""
    params.validate()
    error = _parse_error(params.key())
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=MAX_CHECKED)
def _parse_error(key: tuple[str, str]) -> str | None:
    """None when `key`'s grammar parses, else the message (cached either way)."""
    import json

    try:
        import xgrammar
    except ImportError as exc:  # a request's error, not the server's: the rest keeps serving
        raise ValueError("structured outputs need xgrammar: pip install --no-deps xgrammar==0.2.9") from exc

    kind, text = key
    try:
        if kind == "json":
            json.loads(text)  # the schema must be JSON before xgrammar reads it as a schema
            xgrammar.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(text)
        elif kind == "choice":
            xgrammar.Grammar.from_ebnf(choice_grammar(json.loads(text)))
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError) as exc:
        return str(grammar_error(kind, exc))
    return None
