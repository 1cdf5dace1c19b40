"""StructuredOutputsParams: the grammar a request's output must follow, with vLLM's names (shared: the
frontend builds and checks it, the core compiles it; docs/structured_outputs.md).

Exactly one kind is set: `json` (a JSON schema, as a dict or its text), `regex`, `choice` (one of these
strings), `grammar` (EBNF, xgrammar's dialect of GBNF) or `json_object` (any JSON object). `key()` is the
canonical text both sides cache compiled grammars by.
"""

from __future__ import annotations

import json as _json
import re
from typing import Annotated, Any

import msgspec

KINDS = ("json", "regex", "choice", "grammar", "json_object")
Choice = Annotated[list[str], msgspec.Meta(min_length=1)]


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    json: str | dict[str, Any] | None = None  # a JSON schema; a dict becomes its compact text
    regex: str | None = None
    choice: Choice | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json, separators=(",", ":"))  # key order kept
        self.validate()

    def validate(self) -> None:
        """ValueError unless exactly one kind is set, with a usable value."""
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar or json_object, "
                f"got {chosen or 'none'}"
            )
        kind = chosen[0]
        value = getattr(self, kind)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        elif kind == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be true")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar."""
        kind = self.kind
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the choices."""
    return "root ::= " + " | ".join(_json.dumps(choice, ensure_ascii=False) for choice in choices)


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def grammar_error(kind: str, exc: Exception) -> ValueError:
    """xgrammar's message without its log prefix (time, C++ file and line), naming the field."""
    message = _LOG_PREFIX.sub("", str(exc).strip()).replace("Check failed: (error.empty()) is false: ", "")
    return ValueError(f"structured_outputs.{kind} is invalid: {message}")
