"""Domain errors that map to one precise gRPC status each (DESIGN.md §4).

Core code raises these; the server interceptor turns them into statuses, so no core module
imports grpc. Anything else that escapes an RPC is a bug and becomes INTERNAL.
"""

from __future__ import annotations

import grpc

RETRY_AFTER_KEY = "retry-after-ms"


class ApiError(Exception):
    """An error the caller should see with ``code`` and ``message``."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata sent with the status (e.g. a retry hint); none by default."""
        return ()


class InvalidArgument(ApiError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ApiError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ApiError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ApiError):
    """Over a limit. ``retry_after_ms``, when known, goes out as trailing metadata
    ``retry-after-ms``: the wait after which a retry can succeed."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.retry_after_ms is None:
            return ()
        return ((RETRY_AFTER_KEY, str(max(self.retry_after_ms, 0))),)


class DeadlineExceeded(ApiError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ApiError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(ApiError):
    code = grpc.StatusCode.UNAUTHENTICATED
