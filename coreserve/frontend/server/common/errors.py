"""OpenAI's error body for every failure the server answers (frontend process, HTTP server).

Every invalid request is a 400 `{"error": {"message", "type", "param", "code"}}` naming the field; a bad
API key 401, an unknown model 404, a dead engine 503. FastAPI's own 422 never reaches a client.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from coreserve.frontend.errors import EngineDeadError, RequestFailedError
from coreserve.frontend.server.common.logprob_json import JSONBytesResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error"}
_RANGE_TYPES = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
_LEADING_NAME = re.compile(r"^(?:SamplingParams\.)?(?:the )?([a-z_]+)\b")


class APIError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. a 503's Retry-After


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None):
    return JSONBytesResponse(error_body(status, message, param, code), status_code=status, headers=headers)


async def engine_call(param: str | None, call) -> object:
    """Awaits an AsyncLLM control coroutine; the engine's ValueError (a refused update, a bad level)
    becomes a 400 naming `param`, and the engine goes on serving."""
    try:
        return await call
    except ValueError as exc:
        raise APIError(400, str(exc), param) from exc


def bad_request_from_value_error(exc: ValueError, field_names: frozenset[str]) -> APIError:
    """The engine's and SamplingParams' messages start with the field they are about ("max_tokens must
    be ...", "SamplingParams.temperature=-1.0 is invalid ..."): that name is the param when it is a
    request field. A broken request rule (coreserve/protocol/request_rules.py) names its field itself."""
    message = str(exc)
    if message.startswith("weight_version:"):  # pinned to other weights: at arrival or mid-way alike
        return APIError(409, message, "weight_version", "weight_version_mismatch")
    match = _LEADING_NAME.match(message)
    param = getattr(exc, "param", None)
    if param not in field_names:
        param = match.group(1) if match and match.group(1) in field_names else None
    if param is None and "prompt" in message:
        param = "prompt"
    return APIError(400, message, param)


# Fields whose type is a union: pydantic names each alternative it tried ("function-after[...]"), which
# tells a client nothing; these words say what the field takes.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
_JSON_TYPES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for pydantic's first complaint, e.g. ("max_tokens: Input should be ...", ...)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    if not loc:  # not an object: a JSON array, or a body sent without Content-Type: application/json
        return "the request body must be a JSON object, sent with Content-Type: application/json", None
    path = [part for part in loc if isinstance(part, int) or str(part).isidentifier()]
    field = ".".join(str(part) for part in path)
    if first.get("type") == "extra_forbidden":
        return f"{field} is not a field this server knows (docs/serving.md lists the fields)", str(path[0])
    name = next((str(part) for part in reversed(path) if isinstance(part, str)), "")
    is_type_error = str(first.get("type", "")).endswith("_type")
    if is_type_error and len(path) < len(loc) and name in _EXPECTED:  # no alternative of a union fits
        got = _JSON_TYPES.get(type(first.get("input")), "something else")
        return f"{field} must be {_EXPECTED[name]}, got {got}", str(path[0])
    kind = first.get("type")
    if kind in _RANGE_TYPES:  # pydantic's own name for the bound, which vLLM's messages carry too
        return f"{field}: {first.get('msg')} ({kind})", str(path[0])
    return f"{field}: {first.get('msg')}", str(path[0])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = describe_validation_error(exc)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(503, f"the engine is not running: {exc}", code="engine_dead")

    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, exc: RequestFailedError):
        """The core ended one request (its input, or weights it was pinned to that moved): its own 4xx."""
        error = bad_request_from_value_error(exc, frozenset())
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
