"""Errors in OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise :class:`APIError`; the app's exception handlers turn it, Litestar's own HTTP
exceptions (404 route, 405, 413 body too large) and unexpected exceptions into that envelope.
"""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

import msgspec
import numpy as np
from litestar import Request, Response
from litestar.exceptions import HTTPException

from framework.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("fw.server")

T = TypeVar("T")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client with ``status`` and the OpenAI error envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


#: The deepest JSON nesting accepted in a body (a JSON Schema needs far less).
MAX_JSON_DEPTH = 64

_AT = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``body`` (brackets in strings skipped).

    Vectorized over the positions of quotes and brackets, so an 8 MiB body costs milliseconds: a
    quote opens or closes a string unless an odd run of backslashes precedes it, and a bracket
    counts when an even number of such quotes precede it.
    """
    data = np.frombuffer(body, dtype=np.uint8)
    quotes = np.flatnonzero(data == ord('"'))
    if b'\\"' in body:
        others = np.flatnonzero(data != ord("\\"))  # sorted positions of everything but backslashes
        later = quotes[quotes > 0]
        last_other = others[np.searchsorted(others, later - 1, side="right") - 1] if others.size else later * 0 - 1
        runs = np.zeros(quotes.size, dtype=np.int64)
        runs[quotes > 0] = later - 1 - last_other  # the backslashes right before each quote
        quotes = quotes[runs % 2 == 0]
    opening = (data == ord("[")) | (data == ord("{"))
    positions = np.flatnonzero(opening | (data == ord("]")) | (data == ord("}")))
    if quotes.size:
        positions = positions[np.searchsorted(quotes, positions) % 2 == 0]  # outside strings
    if positions.size == 0:
        return 0
    steps = np.where(opening[positions], 1, -1).astype(np.int64)
    return max(int(np.cumsum(steps).max()), 0)


def decode_body(body: bytes, type_: type[T]) -> T:
    """Decode a JSON body into ``type_``; errors become a 400 naming the field.

    Bodies nested deeper than :data:`MAX_JSON_DEPTH` are refused before decoding, so that no
    recursive code (the decoder, templates, grammar compilers) ever sees them.
    """
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise APIError(
            400,
            f"the JSON body is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted",
            code="invalid_json",
        )
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as error:
        text = str(error)
        at = _AT.search(text)
        path = at.group(1) if at else ""
        missing = _MISSING.search(text)
        if missing:
            param = f"{path}.{missing.group(1)}" if path else missing.group(1)
            raise APIError(
                400, f"missing required parameter {param!r}", param=param, code="missing_required_parameter"
            ) from None
        message = _AT.sub("", text)
        raise APIError(
            400,
            f"invalid type or value for {path!r}: {message}" if path else message,
            param=path or None,
            code="invalid_type",
        ) from None
    except RecursionError:
        raise APIError(
            400,
            f"the JSON body is nested too deeply; at most {MAX_JSON_DEPTH} levels are accepted",
            code="invalid_json",
        ) from None
    except msgspec.DecodeError as error:
        raise APIError(400, f"could not parse the JSON body of the request: {error}", code="invalid_json") from None


#: Anthropic's error types by status (its envelope: ``{"type": "error", "error": {"type", "message"}}``).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
#: Paths whose errors use Anthropic's envelope.
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(error.status, "invalid_request_error"), "message": error.message},
    }


def _error_response(request: Request, error: APIError) -> Response:
    """``error`` in the envelope of the API the request spoke (Anthropic's under /v1/messages, else OpenAI's)."""
    is_anthropic = request.url.path.startswith(ANTHROPIC_PATHS)
    body = anthropic_error_body(error) if is_anthropic else error.body()
    return Response(body, status_code=error.status, headers=error.headers or None)


def api_error_handler(request: Request, error: APIError) -> Response:
    return _error_response(request, error)


def http_exception_handler(request: Request, error: HTTPException) -> Response:
    status = error.status_code
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    message = error.detail or "error"
    headers = dict(error.headers or {})
    path, routes = request.url.path, _routes(request)
    if status == 413:
        message = f"the request body is too large ({message})"
    elif status == 404 and message == "Not Found":  # no route (a handler's own 404 says more)
        listed = "; ".join(f"{' '.join(methods)} {route}" for route, methods in routes.items())
        message = f"no route {request.method} {path} on this server; its routes: {listed}"
    elif status == 405:
        allowed = routes.get(path) or sorted(m for m in headers.get("allow", "").split(", ") if m)
        message = f"method {request.method} is not allowed on {path}; allowed: {', '.join(allowed)}"
        headers["allow"] = ", ".join(allowed)
    return _error_response(request, APIError(status, message, code=code, headers=headers or None))


def _routes(request: Request) -> dict[str, list[str]]:
    """The app's HTTP routes, path -> methods (HEAD and OPTIONS, which every route answers, left out)."""
    routes: dict[str, list[str]] = {}
    for route in request.app.routes:
        methods = sorted(m for m in getattr(route, "methods", ()) if m not in ("HEAD", "OPTIONS"))
        if methods:
            routes.setdefault(route.path, []).extend(methods)
    return dict(sorted(routes.items()))


def internal_error_handler(request: Request, error: Exception) -> Response:
    log.exception("unhandled error", exc_info=error)
    return _error_response(
        request, APIError(500, f"internal server error: {type(error).__name__}: {error}", code="internal_error")
    )


def error_event(error: APIError | Exception) -> dict[str, Any]:
    """The SSE ``data:`` payload for an error that happens mid-stream."""
    if not isinstance(error, APIError):
        error = APIError(500, str(error), code="internal_error")
    return msgspec.to_builtins(error.body())
