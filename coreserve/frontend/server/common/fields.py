"""The field types every dialect's request body is built from (frontend process, HTTP server).

Strict types (a string is not a number, 5.0 is not an int), every integer within the wire's int64, every
float finite, text that is valid Unicode; an unknown field is a 400 naming it (`StrictBody`). `same_json`
compares a field with its no-op value as JSON does.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _valid_unicode(text: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"); they are no text and no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError("is not valid Unicode text (a lone surrogate)") from exc
    return text


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
Text = Annotated[str, AfterValidator(_valid_unicode)]


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictBody):
    """null is taken as false, as vLLM's optional fields read it."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: every chunk carries the usage so far
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks: ignorable, nothing is padded


class SharedSamplingFields(StrictBody):
    """The sampling fields every dialect spells as SamplingParams does (OpenAI's, vLLM's and SGLang's
    bodies take them from here; each adds the fields it names its own way)."""

    n: Annotated[int, Field(ge=1, le=INT64_MAX)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def same_json(value: object, no_op: object) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if isinstance(value, bool) or isinstance(no_op, bool):
        return type(value) is type(no_op) and value == no_op
    return value == no_op
