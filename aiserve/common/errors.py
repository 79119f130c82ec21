"""Domain errors that map to one precise gRPC status each (DESIGN.md §4).

Core code raises these; the server interceptor turns them into statuses, so no core module
imports grpc. Anything else that escapes an RPC is a bug and becomes INTERNAL.
"""

from __future__ import annotations

import grpc


class ApiError(Exception):
    """An error the caller should see with ``code`` and ``message``."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ApiError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ApiError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ApiError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ApiError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ApiError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ApiError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ApiError):
    code = grpc.StatusCode.UNAUTHENTICATED
