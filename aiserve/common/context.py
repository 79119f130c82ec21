"""Per-request context: the request id and trace parent of the RPC being served.

Each gRPC aio RPC runs in its own task, so a ContextVar set by the server interceptor is seen
by everything that RPC does (log lines, downstream calls) and by nothing else.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

REQUEST_ID_KEY = "x-request-id"
AUTHORIZATION_KEY = "authorization"
TRACEPARENT_KEY = "traceparent"
SESSION_KEY = "x-aiserve-session"
"""A client's conversation id: with route_stickiness "session" it keeps the conversation on one
model version."""
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_RE = re.compile(rf"^[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}$")

request_id_var: ContextVar[str] = ContextVar("request_id", default="")
traceparent_var: ContextVar[str] = ContextVar("traceparent", default="")


def mint_request_id() -> str:
    """A new request id: 32 hex characters."""
    return uuid.uuid4().hex


def is_valid_request_id(value: str) -> bool:
    """1 to ``MAX_REQUEST_ID_CHARS`` printable ASCII characters without spaces (it goes into
    logs and headers)."""
    return bool(_REQUEST_ID_RE.match(value))


def current_request_id() -> str:
    return request_id_var.get()


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata a downstream call must carry: the request id and the trace parent."""
    pairs = []
    if rid := request_id_var.get():
        pairs.append((REQUEST_ID_KEY, rid))
    if tp := traceparent_var.get():
        pairs.append((TRACEPARENT_KEY, tp))
    return tuple(pairs)
