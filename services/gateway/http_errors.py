"""Errors of the HTTP door in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the HTTP status of the gRPC code the same failure has on the gRPC API (docs/http.md).

The gateway's validation names its own fields (``sampling.max_new_tokens``); over HTTP the
message and ``param`` name the OpenAI parameter instead (``max_tokens``). Anything that is not
an ``ApiError`` is a bug: a 500 whose message carries the request id, logged with its trace.
"""

from __future__ import annotations

import json
import re

from starlette.responses import JSONResponse

from aiserve.common.context import REQUEST_ID_KEY
from aiserve.common.errors import ApiError, ErrorKind, InvalidArgument, ResourceExhausted
from aiserve.common.logging import get_logger
from services.gateway.openai_request import ParamError

log = get_logger("http")


class PayloadTooLarge(InvalidArgument):
    """A body over ``http_max_body_bytes``: 413 (on gRPC the message size limit is INVALID_ARGUMENT's kin)."""


_STATUS: dict[ErrorKind, tuple[int, str, str]] = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    ErrorKind.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    ErrorKind.NOT_FOUND: (404, "not_found_error", "model_not_found"),
    ErrorKind.ALREADY_EXISTS: (409, "invalid_request_error", "already_exists"),
    ErrorKind.FAILED_PRECONDITION: (412, "failed_precondition", "version_mismatch"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    ErrorKind.CANCELLED: (499, "cancelled", "cancelled"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
}
"""gRPC code (docs/architecture.md, "Status codes") -> HTTP status, OpenAI error type and code."""
_INTERNAL = (500, "server_error", "internal_error")

_FIELDS = (
    ("sampling.max_new_tokens", "max_tokens"), ("sampling.", ""), ("chat.messages", "messages"),
    ("cache_min_similarity", "cache_min_similarity"),
)
"""The gateway's field names -> OpenAI's parameters, by prefix, first match wins."""
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def openai_message(message: str, is_chat: bool) -> tuple[str, str | None]:
    """A gateway validation message with OpenAI's parameter name, and that parameter."""
    for ours, theirs in _FIELDS:
        if message.startswith(ours):
            message = theirs + message[len(ours):]
            break
    else:
        if is_chat and message.startswith("prompt:"):  # a chat's prompt is its messages
            message = "messages" + message[len("prompt"):]
    match = _PARAM.match(message)
    return message, match.group(1) if match else None


def error_response(status: int, kind: str, message: str, param: str | None, code: str, request_id: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers={REQUEST_ID_KEY: request_id, **(headers or {})})


def _parts(exc: BaseException, request_id: str, is_chat: bool) -> tuple[int, str, str, str | None, str]:
    """(status, type, message, param, code) of an exception."""
    if isinstance(exc, PayloadTooLarge):
        return 413, "invalid_request_error", exc.message, "body", "payload_too_large"
    if isinstance(exc, ParamError):
        return 400, "invalid_request_error", exc.message, exc.param, "invalid_value"
    if isinstance(exc, ApiError) and exc.kind in _STATUS:
        status, kind, code = _STATUS[exc.kind]
        message, param = openai_message(exc.message, is_chat) if status == 400 else (exc.message, None)
        return status, kind, message, param, code
    if isinstance(exc, ApiError):  # INTERNAL or UNKNOWN from a backend: already names what failed
        return 500, _INTERNAL[1], f"{exc.message} (request_id={request_id})", None, _INTERNAL[2]
    log.error("http_bug", request_id=request_id, error=repr(exc), exc_info=exc)
    return 500, _INTERNAL[1], f"internal error (request_id={request_id})", None, _INTERNAL[2]


def response_of(exc: BaseException, request_id: str, is_chat: bool) -> JSONResponse:
    """The error response of ``exc`` (429s carry Retry-After in seconds and retry-after-ms)."""
    status, kind, message, param, code = _parts(exc, request_id, is_chat)
    headers = {}
    if isinstance(exc, ResourceExhausted) and exc.retry_after_ms is not None:
        wait_ms = max(exc.retry_after_ms, 0)
        headers = {"retry-after": str(-(-wait_ms // 1000)), "retry-after-ms": str(wait_ms)}
    return error_response(status, kind, message, param, code, request_id, headers)


def error_event(exc: BaseException, request_id: str, is_chat: bool = True) -> bytes:
    """An error after the stream began: one ``data:`` event with the error object."""
    status, kind, message, param, code = _parts(exc, request_id, is_chat)
    body = {"error": {"message": message, "type": kind, "param": param, "code": code, "status": status}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
