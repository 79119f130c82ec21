"""The server end of GenerateMux: many generations over one call, one message per engine step.

With a Generate call per generation, a step of 64 sequences is 64 gRPC messages out of this
process and 64 into the gateway, each with its own task wake-up, write and read; on a machine
whose cores the model fills, that CPU comes off the model (docs/engine.md). Here the engine
hands each event to ``_deliver`` (no task per generation), which appends it to the call's
outbox; one writer loop sends whatever has gathered, and the engine posts a whole step's
events in one loop callback, so a step is usually one message.

Each stream behaves as a Generate call: the same messages, the same errors (as an event with a
code, for that stream only), its deadline, and cancellation (a ``cancel`` item, or the call's
end, takes the generation out of the batch at the next step and frees its KV slot).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from aiserve.common.errors import (
    ApiError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from aiserve.common.interceptors import RpcMetrics
from aiserve.common.logging import get_logger
from aiserve.common.protocol import MAX_MUX_STREAMS
from aiserve.common.status import grpc_code
from aiserve.v1 import inference_pb2
from services.inference.batch_engine import BatchEngine
from services.inference.messages import from_pb, to_pb
from services.inference.request import TokenEvent

log = get_logger("generate_mux")

# The per-stream outcome in aiserve_rpc_total / _seconds, beside the call's own line.
STREAM_METHOD = "/aiserve.v1.Inference/GenerateMux:stream"


@dataclass(eq=False, slots=True)
class _Stream:
    """One generation on the call."""

    stream: int
    request_id: str
    started: float = field(default_factory=time.perf_counter)
    cancel: Callable[[], None] = lambda: None
    """Takes the generation out of the engine (set once it is queued)."""
    timer: asyncio.TimerHandle | None = None
    completion_tokens: int = 0


class MuxCall:
    """One GenerateMux call: its open streams and the events waiting to go out."""

    def __init__(self, engine: BatchEngine, model_ref: str, metrics: RpcMetrics) -> None:
        self._engine, self._model_ref, self._metrics = engine, model_ref, metrics
        self._streams: dict[int, _Stream] = {}
        self._outbox: list[inference_pb2.GenerateMuxEvent] = []
        self._wake = asyncio.Event()
        self._is_reading = True
        self._is_stopping = False

    def stop(self) -> None:
        """The service is stopping: refuse new streams; end the call once the open ones end."""
        self._is_stopping = True
        self._wake.set()

    async def run(self, requests: AsyncIterator[inference_pb2.GenerateMuxRequest]
                  ) -> AsyncIterator[inference_pb2.GenerateMuxResponse]:
        """The call's responses. Ends when the caller has stopped writing (or the service is
        stopping) and no stream is open; when the call ends, open generations are cancelled."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._outbox:
                    events, self._outbox = self._outbox, []
                    yield inference_pb2.GenerateMuxResponse(events=events)
                if not self._streams and (self._is_stopping or not self._is_reading):
                    return
        finally:
            reader.cancel()
            for stream in list(self._streams.values()):
                self._end(stream, grpc.StatusCode.CANCELLED)
                stream.cancel()

    async def _read(self, requests: AsyncIterator[inference_pb2.GenerateMuxRequest]) -> None:
        try:
            async for request in requests:
                for index, item in enumerate(request.items):
                    self._item(index, item)
        except Exception as exc:  # noqa: BLE001 - the caller's side broke; the call ends with it
            log.info("generate_mux_read_ended", error=f"{type(exc).__name__}: {exc}")
        finally:
            self._is_reading = False
            self._wake.set()

    def _item(self, index: int, item: inference_pb2.GenerateMuxItem) -> None:
        if item.cancel:
            if (stream := self._streams.get(item.stream)) is not None:
                self._end(stream, grpc.StatusCode.CANCELLED)
                stream.cancel()
            return
        try:
            self._start(index, item)
        except ApiError as exc:
            self._error(item.stream, item.request.request_id, exc)
            if (stream := self._streams.get(item.stream)) is not None:  # a second start closes it too
                self._end(stream, grpc_code(exc.kind))
                stream.cancel()
        except Exception as exc:  # noqa: BLE001 - a bug fails this stream (INTERNAL), not the call
            log.exception("generate_mux_start_failed", request_id=item.request.request_id)
            if item.stream not in self._streams:
                self._error(item.stream, item.request.request_id, exc)

    def _start(self, index: int, item: inference_pb2.GenerateMuxItem) -> None:
        if not item.HasField("request"):
            raise InvalidArgument(f"items[{index}].request: required unless cancel is set")
        if item.stream in self._streams:
            raise FailedPrecondition(f"items[{index}].stream: {item.stream} is already open")
        if self._is_stopping:
            raise Unavailable("inference is stopping; retry on another replica")
        if len(self._streams) >= MAX_MUX_STREAMS:
            raise ResourceExhausted(f"items[{index}].stream: at most {MAX_MUX_STREAMS} streams may be open "
                                    "in one call")
        request = item.request
        if request.model and request.model != self._model_ref:
            raise NotFound(f"model: {request.model!r} is not loaded here (this is {self._model_ref})")
        timeout_s = item.timeout_ms / 1000 if item.timeout_ms else None
        domain = from_pb(request, None if timeout_s is None else time.monotonic() + timeout_s)
        stream = _Stream(item.stream, domain.request_id)
        stream.cancel = self._engine.submit(domain, lambda event: self._deliver(stream, event))
        self._streams[item.stream] = stream
        if timeout_s is not None:
            stream.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, stream)

    def _deliver(self, stream: _Stream, event: TokenEvent | BaseException) -> None:
        if self._streams.get(stream.stream) is not stream:
            return  # cancelled or expired meanwhile
        if isinstance(event, BaseException):
            self._error(stream.stream, stream.request_id, event)
            self._end(stream, grpc_code(event.kind) if isinstance(event, ApiError) else grpc.StatusCode.INTERNAL)
            return
        stream.completion_tokens = event.completion_tokens
        self._outbox.append(inference_pb2.GenerateMuxEvent(
            stream=stream.stream, response=to_pb(stream.request_id, event)))
        self._wake.set()
        if event.finish_reason is not None:
            self._end(stream, grpc.StatusCode.OK)

    def _expire(self, stream: _Stream) -> None:
        """Its deadline passed while it ran (a queued one is failed by the engine itself)."""
        if self._streams.get(stream.stream) is stream:
            stream.timer = None
            self._error(stream.stream, stream.request_id, DeadlineExceeded(
                f"deadline passed after {stream.completion_tokens} generated tokens"))
            self._end(stream, grpc.StatusCode.DEADLINE_EXCEEDED)
            stream.cancel()

    def _error(self, stream: int, request_id: str, exc: BaseException) -> None:
        if isinstance(exc, ApiError):
            code, message = grpc_code(exc.kind), exc.message
        else:  # the engine's step failed: a bug, reported as Generate's interceptor would
            log.error("generation_failed", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
            code, message = grpc.StatusCode.INTERNAL, f"internal error (request_id={request_id})"
        self._outbox.append(inference_pb2.GenerateMuxEvent(stream=stream, code=code.value[0], message=message))
        self._wake.set()
        if stream not in self._streams:  # refused before it opened: its only log line
            self._record(request_id, code, 0.0, 0)

    def _end(self, stream: _Stream, code: grpc.StatusCode) -> None:
        """Close ``stream`` (its last event is already queued, or none is owed)."""
        del self._streams[stream.stream]
        if stream.timer is not None:
            stream.timer.cancel()
        self._record(stream.request_id, code, time.perf_counter() - stream.started, stream.completion_tokens)
        if not self._streams:
            self._wake.set()  # the call may be over

    def _record(self, request_id: str, code: grpc.StatusCode, elapsed_s: float, completion_tokens: int) -> None:
        """What the interceptor records for a Generate call, for one stream."""
        self._metrics.record(STREAM_METHOD, code, elapsed_s)
        log.info("rpc", method=STREAM_METHOD, request_id=request_id, code=code.name,
                 latency_ms=round(elapsed_s * 1000, 2), completion_tokens=completion_tokens)
