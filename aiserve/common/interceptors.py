"""The interceptors, in one fixed order (STYLE.md).

Server side, one interceptor does, for every RPC of the service's own API: take or mint the
``x-request-id`` and bind it (ContextVar -> every log line), echo it in the initial metadata,
log the outcome and latency, count it in Prometheus, and turn exceptions into precise statuses
(ApiError -> its code; anything else -> INTERNAL naming the request id; the server keeps
serving). Client side, one interceptor forwards the request id and trace parent on every
downstream call, so no call site can forget them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Histogram

from aiserve.common.context import (
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID_KEY,
    TRACEPARENT_KEY,
    is_valid_request_id,
    mint_request_id,
    outgoing_metadata,
    request_id_var,
    traceparent_var,
)
from aiserve.common.errors import ApiError
from aiserve.common.logging import get_logger
from aiserve.common.protocol import MAX_MESSAGE_BYTES
from aiserve.common.status import grpc_code

log = get_logger("rpc")

KEEPALIVE_TIME_MS = 10_000
"""Every downstream channel pings its backend this often (servers permit it: ``server.py``)."""
KEEPALIVE_TIMEOUT_MS = 5_000
"""A ping unanswered this long closes the connection: its calls fail with UNAVAILABLE."""

_RPC_BUCKETS = (0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RpcMetrics:
    """``aiserve_rpc_total`` and ``aiserve_rpc_seconds`` of one server, in its own registry."""

    def __init__(self, service: str, registry: CollectorRegistry) -> None:
        self.service = service
        self.total = Counter("aiserve_rpc_total", "RPCs served", ["service", "method", "code"], registry=registry)
        self.seconds = Histogram("aiserve_rpc_seconds", "RPC latency in seconds (streams: until the last message)",
                                 ["service", "method"], buckets=_RPC_BUCKETS, registry=registry)

    def record(self, method: str, code: grpc.StatusCode, elapsed_s: float) -> None:
        """Count one finished RPC (or one stream of a multiplexed call) and its latency."""
        self.total.labels(self.service, method, code.name).inc()
        self.seconds.labels(self.service, method).observe(elapsed_s)

# Infrastructure services: not logged per call (health probes would drown the logs).
_QUIET_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class _Call:
    """Bookkeeping of one RPC: binds its ids, then maps its outcome to a status and a log line."""

    def __init__(self, metrics: RpcMetrics, method: str, context: aio.ServicerContext) -> None:
        self.metrics, self.method, self.context = metrics, method, context
        self.started = time.perf_counter()
        self.code = grpc.StatusCode.OK
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        given = metadata.get(REQUEST_ID_KEY, "")
        self.request_id = given if given and is_valid_request_id(given) else mint_request_id()
        self.bad_request_id = bool(given) and given != self.request_id
        request_id_var.set(self.request_id)
        traceparent_var.set(metadata.get(TRACEPARENT_KEY, "")[:256])

    async def begin(self) -> None:
        await self.context.send_initial_metadata(((REQUEST_ID_KEY, self.request_id),))
        if self.bad_request_id:
            self.code = grpc.StatusCode.INVALID_ARGUMENT
            await self.context.abort(
                self.code, f"{REQUEST_ID_KEY}: must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII characters"
            )

    async def fail(self, exc: BaseException) -> None:
        if isinstance(exc, ApiError):
            self.code = grpc_code(exc.kind)
            await self.context.abort(self.code, exc.message, trailing_metadata=exc.trailing_metadata)
        self.code = grpc.StatusCode.INTERNAL
        log.exception("rpc_bug", method=self.method)
        await self.context.abort(self.code, f"internal error (request_id={self.request_id})")

    def finish(self, exc: BaseException | None = None) -> None:
        if isinstance(exc, asyncio.CancelledError):
            self.code = grpc.StatusCode.CANCELLED
        elif isinstance(exc, aio.AbortError) and self.code == grpc.StatusCode.OK:
            self.code = self.context.code() or grpc.StatusCode.UNKNOWN  # type: ignore[assignment]
        elapsed = time.perf_counter() - self.started
        self.metrics.record(self.method, self.code, elapsed)
        log.info("rpc", method=self.method, code=self.code.name, latency_ms=round(elapsed * 1000, 2))


class ServerInterceptor(aio.ServerInterceptor):
    """Request id, logging, metrics and error mapping for every RPC of one server."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(_QUIET_PREFIXES):
            return handler
        kinds: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
            "unary_unary": (self._unary, grpc.unary_unary_rpc_method_handler),
            "stream_unary": (self._unary, grpc.stream_unary_rpc_method_handler),
            "unary_stream": (self._streaming, grpc.unary_stream_rpc_method_handler),
            "stream_stream": (self._streaming, grpc.stream_stream_rpc_method_handler),
        }
        for attr, (wrap, make) in kinds.items():
            if (behavior := getattr(handler, attr)) is not None:
                return make(  # type: ignore[no-any-return]
                    wrap(behavior, method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _unary(self, behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
        async def wrapper(request: Any, context: aio.ServicerContext) -> Any:
            call = _Call(self.metrics, method, context)
            error: BaseException | None = None
            try:
                await call.begin()
                return await behavior(request, context)
            except (aio.AbortError, asyncio.CancelledError) as exc:
                error = exc
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never crashes the server
                error = aio.AbortError()
                await call.fail(exc)
            finally:
                call.finish(error)

        return wrapper

    def _streaming(self, behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
        async def wrapper(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(self.metrics, method, context)
            error: BaseException | None = None
            try:
                await call.begin()
                async for message in behavior(request, context):
                    yield message
            except (aio.AbortError, asyncio.CancelledError, GeneratorExit) as exc:
                error = asyncio.CancelledError() if isinstance(exc, GeneratorExit) else exc
                raise
            except Exception as exc:  # noqa: BLE001
                error = aio.AbortError()
                await call.fail(exc)
            finally:
                call.finish(error)

        return wrapper


def _with_context(details: aio.ClientCallDetails) -> aio.ClientCallDetails:
    metadata = aio.Metadata(*(details.metadata or ()))
    for key, value in outgoing_metadata():
        if key not in metadata:
            metadata.add(key, value)
    return details._replace(metadata=metadata)  # type: ignore[attr-defined,no-any-return]


class _ForwardUnaryUnary(aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_context(client_call_details), request)


class _ForwardUnaryStream(aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_context(client_call_details), request)


class _ForwardStreamUnary(aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(_with_context(client_call_details), request_iterator)


class _ForwardStreamStream(aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(_with_context(client_call_details), request_iterator)


def forward_context_interceptors() -> list[aio.ClientInterceptor]:
    """Interceptors that add the current request id and trace parent to every outgoing call.

    One object per call kind: grpc.aio files each interceptor under the first call kind it
    matches, so a single class deriving from all four would only see unary-unary calls.
    """
    return [_ForwardUnaryUnary(), _ForwardUnaryStream(), _ForwardStreamUnary(), _ForwardStreamStream()]


DOWNSTREAM_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 1),
    # Backends live on the same host or mesh: reconnect quickly after a restart, and at start
    # see a backend within 250 ms of it listening (with 1 s the gateway reported SERVING up
    # to 0.8 s after the inference service did: README, "Cold start").
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
    # A replica that vanishes without closing its socket (a node lost) is noticed within
    # KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS even while no call is running.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # No bandwidth-delay probing: its pings only size windows for long fat links, and here
    # they would count against the backend's ping limit (aiserve/common/server.py).
    ("grpc.http2.bdp_probe", 0),
]
"""The options of every channel from one aiserve service to another (``downstream_channel``)."""


def downstream_channel(address: str) -> aio.Channel:
    """An insecure channel to another aiserve service that forwards the request context."""
    return aio.insecure_channel(address, options=DOWNSTREAM_OPTIONS, interceptors=forward_context_interceptors())
