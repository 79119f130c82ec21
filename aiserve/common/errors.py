"""Domain errors, one kind each, that the caller sees as one precise status (docs/architecture.md,
"Status codes").

Core code raises these; it never imports grpc. ``aiserve/common/status.py`` maps a kind to its
gRPC status code at the edge (the server interceptor, the multiplexed calls' per-stream codes,
a backend's status read back by the gateway). Anything else that escapes an RPC is a bug and
becomes INTERNAL.
"""

from __future__ import annotations

import enum

RETRY_AFTER_KEY = "retry-after-ms"


class ErrorKind(enum.Enum):
    """What went wrong, as a caller must see it. Each name is the gRPC status code it maps to."""

    INVALID_ARGUMENT = enum.auto()
    NOT_FOUND = enum.auto()
    ALREADY_EXISTS = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    DEADLINE_EXCEEDED = enum.auto()
    UNAVAILABLE = enum.auto()
    UNAUTHENTICATED = enum.auto()
    PERMISSION_DENIED = enum.auto()
    CANCELLED = enum.auto()
    INTERNAL = enum.auto()
    UNKNOWN = enum.auto()


class ApiError(Exception):
    """An error the caller should see with its ``kind`` and ``message``."""

    kind: ErrorKind = ErrorKind.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata sent with the status (e.g. a retry hint); none by default."""
        return ()

    def fresh(self) -> ApiError:
        """A new instance with the same kind and message: one exception object raised in many
        tasks would share (and keep rewriting) one traceback."""
        return error_of(self.kind, self.message)


class InvalidArgument(ApiError):
    kind = ErrorKind.INVALID_ARGUMENT


class NotFound(ApiError):
    kind = ErrorKind.NOT_FOUND


class AlreadyExists(ApiError):
    """What the caller asked to create is there already (a version already on its route)."""

    kind = ErrorKind.ALREADY_EXISTS


class FailedPrecondition(ApiError):
    kind = ErrorKind.FAILED_PRECONDITION


class ResourceExhausted(ApiError):
    """Over a limit. ``retry_after_ms``, when known, goes out as trailing metadata
    ``retry-after-ms``: the wait after which a retry can succeed."""

    kind = ErrorKind.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.retry_after_ms is None:
            return ()
        return ((RETRY_AFTER_KEY, str(max(self.retry_after_ms, 0))),)

    def fresh(self) -> ApiError:
        return ResourceExhausted(self.message, self.retry_after_ms)


class DeadlineExceeded(ApiError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class Unavailable(ApiError):
    kind = ErrorKind.UNAVAILABLE


class Unauthenticated(ApiError):
    kind = ErrorKind.UNAUTHENTICATED


class PermissionDenied(ApiError):
    """The caller is known but may not do this (a tenant's key on the Admin service)."""

    kind = ErrorKind.PERMISSION_DENIED


class Cancelled(ApiError):
    kind = ErrorKind.CANCELLED


class Internal(ApiError):
    """A backend reported a bug; the message already names what failed."""

    kind = ErrorKind.INTERNAL


_BY_KIND: dict[ErrorKind, type[ApiError]] = {
    cls.kind: cls for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, ResourceExhausted,
                              DeadlineExceeded, Unavailable, Unauthenticated, PermissionDenied, Cancelled, Internal)
}


def error_of(kind: ErrorKind, message: str) -> ApiError:
    """The ApiError of ``kind`` (UNKNOWN and kinds without a class of their own: ApiError)."""
    cls = _BY_KIND.get(kind)
    if cls is None:
        error = ApiError(message)
        error.kind = kind
        return error
    return cls(message)
