"""The gateway's end of the inference service's GenerateMux: every running generation shares
one call (docs/decisions.md, decision 34).

The edge: the ``Generations`` of ``services/gateway/interfaces.py`` over the shared call.
With a Generate call per generation, each engine step of 64 sequences was 64 gRPC messages out
of the inference process and 64 into the gateway; over the shared call it is usually one each,
since the inference service sends a step's events together (the service's end of the call).
Each generation reads the same events a Generate call would give (``generate_call_client.py``)
and gets the same errors; if the call breaks (the inference service restarted), the
generations on it fail with UNAVAILABLE and the next one opens a new call.
"""

from __future__ import annotations

import asyncio
import math

from aiserve.common.errors import ApiError, DeadlineExceeded
from aiserve.v1 import inference_pb2, inference_pb2_grpc
from services.gateway.backend_errors import item_error
from services.gateway.domain import GenerationEvent, GenerationRequest
from services.gateway.inference_messages import event_from_pb, request_to_pb
from services.gateway.shared_call import Reopening, SharedCall

_Item = inference_pb2.InferenceResponse | ApiError | RuntimeError


class _Call(SharedCall[inference_pb2.GenerateMuxItem]):
    """One GenerateMux call and the queues of the generations on it."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        self.streams: dict[int, asyncio.Queue[_Item]] = {}
        super().__init__("inference", "generation", stub.GenerateMux,
                         lambda items: inference_pb2.GenerateMuxRequest(items=items))

    def on_reply(self, reply: inference_pb2.GenerateMuxResponse) -> None:
        for event in reply.events:
            queue = self.streams.get(event.stream)
            if queue is None:
                continue  # its generation was cancelled meanwhile
            if event.code:
                del self.streams[event.stream]
                queue.put_nowait(item_error("inference", event.code, event.message))
                continue
            queue.put_nowait(event.response)
            if event.response.finish_reason:
                del self.streams[event.stream]

    def on_fail(self, error: ApiError) -> None:
        for queue in self.streams.values():
            queue.put_nowait(error.fresh())
        self.streams.clear()


class GenerateMuxClient:
    """Starts ``MuxGeneration``s over a shared GenerateMux call."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        self._calls = Reopening(lambda: _Call(stub))

    def open(self, request: GenerationRequest, timeout_s: float) -> MuxGeneration:
        """Start ``request`` with ``timeout_s`` to its deadline (it is queued on the call now)."""
        return MuxGeneration(*self._calls.next(), request_to_pb(request), timeout_s)

    async def close(self) -> None:
        await self._calls.close()


class MuxGeneration:
    """One generation over the shared call: ``read`` its messages until one carries
    finish_reason (or an error is raised), and ``close`` always (it cancels the generation on
    the inference service unless it ended)."""

    def __init__(self, current: _Call, stream: int, request: inference_pb2.InferenceRequest,
                 timeout_s: float) -> None:
        self._current, self._stream = current, stream
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._is_ended = False
        current.streams[stream] = self._queue
        current.send(inference_pb2.GenerateMuxItem(stream=stream, request=request,
                                                   timeout_ms=max(1, math.ceil(timeout_s * 1000))))

    async def read(self, timeout_s: float) -> GenerationEvent:
        """The next event. Raises the generation's error (Generate's codes), or
        DeadlineExceeded when nothing comes within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                item = await self._queue.get()
        except TimeoutError:
            raise DeadlineExceeded("inference: no token before the deadline") from None
        if isinstance(item, Exception):
            self._is_ended = True
            raise item
        if item.finish_reason:
            self._is_ended = True
        return event_from_pb(item)

    def close(self) -> None:
        """Cancel the generation unless it ended (no answer is awaited)."""
        if self._is_ended:
            return
        self._is_ended = True
        current = self._current
        if current.streams.pop(self._stream, None) is not None and current.error is None:
            current.send(inference_pb2.GenerateMuxItem(stream=self._stream, cancel=True))
