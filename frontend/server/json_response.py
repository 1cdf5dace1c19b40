"""JSON bodies encoded by msgspec (frontend process, HTTP server).

Faster than the standard library for the many small floats of logprob responses; float values are made
finite by the formatters before they get here (OpenAI writes -inf as -9999.0), so nothing is lost.
"""

from __future__ import annotations

import json

import msgspec
from starlette.responses import Response


def to_json(content: object) -> bytes:
    """UTF-8 JSON; a string that is not valid Unicode (which no formatter should let through) is written
    with \\u escapes rather than failing the response."""
    try:
        return msgspec.json.encode(content)
    except UnicodeEncodeError:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class JSONBytesResponse(Response):
    media_type = "application/json"

    def render(self, content: object) -> bytes:
        return to_json(content)
