"""The one place a request's SamplingParams is built, whatever the dialect (frontend process, HTTP server).

Each dialect names its fields its own way (OpenAI's `max_tokens`, SGLang's `max_new_tokens`, vLLM's
`sampling_params` dict); it hands `build_sampling_params` a dict under SamplingParams' own names, and
`same_name_fields` collects the body's fields whose names SamplingParams shares, so the list of
sampling fields is written once: SamplingParams' own struct. A value SamplingParams refuses becomes the
dialect's 400 through `refusal`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from coreserve.frontend.server.common.errors import APIError
from coreserve.protocol.sampling_params import SamplingParams

# What a request body may set: every field but the adapter, which only the request's "model" names (a
# body naming a path would make the core read any folder of its host)
SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__) - {"lora"}


def same_name_fields(
    body: BaseModel, renames: Mapping[str, str] | None = None, computed: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The body's fields that SamplingParams has (under `renames[name]` where the dialect names it
    otherwise), those left unset (None) out so that SamplingParams' defaults hold; `computed`: the
    SamplingParams names the dialect fills itself from other fields (left out here)."""
    renames = renames or {}
    fields = {}
    for name in type(body).model_fields:
        target = renames.get(name, name)
        if target in SAMPLING_FIELDS and target not in computed and (value := getattr(body, name)) is not None:
            fields[target] = value
    return fields


def build_sampling_params(fields: dict[str, Any], refusal: Callable[[ValueError], APIError]) -> SamplingParams:
    """SamplingParams(**fields); a name SamplingParams lacks is a dialect's bug (checked before), a
    value it refuses is `refusal(exc)`, the dialect's 400."""
    assert set(fields) <= SAMPLING_FIELDS, sorted(set(fields) - SAMPLING_FIELDS)
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise refusal(exc) from exc


def field_refusal(param: str, prefix: str = "") -> Callable[[ValueError], APIError]:
    """A refusal naming one field: `prefix` + SamplingParams' message."""
    return lambda exc: APIError(400, f"{prefix}{exc}", param)
