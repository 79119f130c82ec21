"""Error kinds <-> gRPC status codes: the one place they meet (the edge of every service).

The domain raises ``ApiError``s with an ``ErrorKind`` (``aiserve/common/errors.py``, no grpc);
the server interceptor, the multiplexed calls' per-stream codes and the gateway's reading of a
backend's status convert here.
"""

from __future__ import annotations

import grpc

from aiserve.common.errors import ErrorKind

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def grpc_code(kind: ErrorKind) -> grpc.StatusCode:
    """The status code of an error kind (the names are the same)."""
    return grpc.StatusCode[kind.name]


def kind_of(code: grpc.StatusCode) -> ErrorKind:
    """The error kind of a status code; codes the domain never raises are UNKNOWN."""
    return ErrorKind.__members__.get(code.name, ErrorKind.UNKNOWN)


def code_number(kind: ErrorKind) -> int:
    """The wire number of ``kind``'s status code (the ``code`` field of a multiplexed item)."""
    return int(grpc_code(kind).value[0])


def code_of_number(number: int) -> grpc.StatusCode:
    """The status code of a wire number; numbers gRPC does not know are UNKNOWN."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)

