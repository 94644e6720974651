"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, and the exception handlers
that turn validation failures, HTTP errors and crashes into them.

`param` is the client's own path to the field ("messages[0].content", "speculative.draft_max"),
never a pydantic location; the same kind of error always has the same `code`:

    invalid_json                the body is empty, not UTF-8 or not JSON
    invalid_type                a value (or the body) of the wrong JSON type ("8" for an integer, true for a seed)
    invalid_value               a value out of range or not one of the allowed ones
    missing_required_parameter  a required field is absent
    unknown_parameter           a field the API does not have
    unsupported_parameter / unsupported_value   OpenAI has it, localspec cannot honour it
    context_length_exceeded     the prompt does not fit the context
    invalid_api_key (401), origin_not_allowed / host_not_allowed (403), model_not_found / unknown_url (404),
    method_not_allowed (405), request_timeout (408), request_too_large (413), rate_limit_exceeded (429),
    server_shutting_down (503); a server error (500) has no code.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("localspec.server")

SERVER_ERROR = "The server had an error while processing your request."
SHUTTING_DOWN = "The server is shutting down; retry later."
SHUTDOWN_RETRY_AFTER = 10  # seconds: Retry-After on a 503 while shutting down (a restart takes a few)

_ERROR_TYPES = {401: "invalid_request_error", 403: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An OpenAI-shaped error response: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def shutting_down() -> APIError:
    return APIError(503, SHUTTING_DOWN, code="server_shutting_down",
                    headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER)})


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {limit} bytes.",
                    code="request_too_large", headers={"Connection": "close"})


def invalid_json(reason: str) -> APIError:
    return APIError(400, f"The request body is not valid JSON ({reason}); send one JSON object.", code="invalid_json")


# ---------------------------------------------------------------- request validation (pydantic)

_JSON_TYPES = {"string": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
               "list": "an array", "dict": "an object", "model": "an object", "model_attributes": "an object",
               "none": "null", "literal": None}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number" if value == value and abs(value) != float("inf") else "a non-finite number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def client_path(loc: Iterable[Any], body: Any) -> str | None:
    """The client's path to the field an error location points at: pydantic's location, with the
    union member tags it inserts ("Speculative", "str", "list[str]") dropped by walking the body
    the client sent; "messages[0].content"."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out, node = "", body
    for i, part in enumerate(parts):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            out += f".{part}" if out else part
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
            node = node[part] if -len(node) <= part < len(node) else None
        elif isinstance(node, dict) and isinstance(part, str) and i == len(parts) - 1 and not _is_tag(part):
            out += f".{part}" if out else part  # a missing field: not in the body, but the client's name
            node = None
        # else: a union member tag (or past the body's end): not part of the client's path
    return out or None


def _is_tag(part: str) -> bool:
    """Pydantic's union member tags: class names and type expressions, never a field name here
    (fields are snake_case)."""
    return part[:1].isupper() or "[" in part or part in ("str", "int", "float", "bool", "none", "dict", "list")


def _expected(kind: str, ctx: dict | None) -> str | None:
    if kind == "literal_error":
        return f"one of {(ctx or {}).get('expected', 'the allowed values')}"
    base = kind.removesuffix("_type").removesuffix("_parsing")
    return _JSON_TYPES.get(base)


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    body = getattr(exc, "body", None)
    if not errors:
        return APIError(400, "Invalid request.", code="invalid_value")
    located = [(client_path(e.get("loc", ()), body), e) for e in errors]
    # the most specific error: the longest client path ("stop[0]" over "stop")
    param, err = max(located, key=lambda pe: len(pe[0] or ""))
    kind = err.get("type", "")
    if kind == "json_invalid":
        return invalid_json((err.get("ctx") or {}).get("error", "decode error").lower())
    if param is None:
        if kind == "missing":
            return APIError(400, "The request body is empty; send one JSON object.", code="invalid_json")
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return APIError(400, f"The request body must be a JSON object, not {_json_type(err.get('input'))}.",
                            code="invalid_type")
        return APIError(400, f"Invalid request: {err.get('msg')}.", code="invalid_value")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    same = [e for p, e in located if p == param]
    expected = [x for x in dict.fromkeys(_expected(e.get("type", ""), e.get("ctx")) for e in same) if x]
    ctx = err.get("ctx") or {}
    if kind == "option_type":  # a generation option's field (schemas.option_field): its rule says what it takes
        return APIError(400, f"Invalid type for '{param}': {ctx['rule']}, but got {_json_type(err.get('input'))} "
                             "instead.", param=param, code="invalid_type")
    if kind.endswith("_type") or (kind == "literal_error" and len(expected) > 1):
        got = _json_type(err.get("input"))
        want = " or ".join(expected) if expected else "another type"
        return APIError(400, f"Invalid type for '{param}': expected {want}, but got {got} instead.",
                        param=param, code="invalid_type")
    error = ctx.get("error")  # a validator's own exception: its message, without pydantic's prefix
    msg = str(error) if isinstance(error, Exception) else str(err.get("msg", "invalid value"))
    return APIError(400, f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


# ---------------------------------------------------------------- the handlers


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc).response()


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        error = APIError(404, f"Unknown endpoint: {request.method} {request.url.path}", code="unknown_url")
    elif exc.status_code == 405:
        error = APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                         code="method_not_allowed", headers=getattr(exc, "headers", None))
    elif exc.status_code == 400:  # FastAPI: a body it could not decode
        error = invalid_json(str(exc.detail).lower())
    else:
        error = APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
    return error.response()


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, SERVER_ERROR).response()
