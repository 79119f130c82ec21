"""A backend's gRPC status as the gateway's caller sees it (the adapters' one rule).

The edge: every adapter that calls a backend turns a failed call into an ``ApiError`` here, so
the core only ever sees domain errors.
"""

from __future__ import annotations

import grpc

from aiserve.common.errors import ApiError, ErrorKind, Unavailable, error_of
from aiserve.common.status import code_of_number, kind_of

# A backend's status that is the caller's own mistake (or a limit) reaches the caller as it is.
_PASS_THROUGH = frozenset({ErrorKind.INVALID_ARGUMENT, ErrorKind.NOT_FOUND, ErrorKind.FAILED_PRECONDITION,
                           ErrorKind.RESOURCE_EXHAUSTED, ErrorKind.DEADLINE_EXCEEDED})


def status_error(service: str, code: grpc.StatusCode, details: str) -> ApiError | RuntimeError:
    """A backend's status as the caller should see it: its own code for a caller's mistake,
    UNAVAILABLE when the backend cannot be reached; anything else stays a bug (a RuntimeError,
    which the server interceptor reports as INTERNAL)."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"{service} unavailable: {details}")
    if (kind := kind_of(code)) in _PASS_THROUGH:
        return error_of(kind, details)
    return RuntimeError(f"{service} failed with {code.name}: {details}")


def downstream_error(service: str, exc: grpc.RpcError) -> ApiError:
    """``status_error`` of a failed call; raises the RuntimeError of an unexpected code."""
    code = exc.code()  # type: ignore[attr-defined]
    error = status_error(service, code, exc.details() or code.name)  # type: ignore[attr-defined]
    if isinstance(error, RuntimeError):
        raise error from exc
    return error


def item_error(service: str, code: int, message: str) -> ApiError | RuntimeError:
    """The error of one generation's item on a shared call, from the code and message it carries."""
    return status_error(service, code_of_number(code), message)
