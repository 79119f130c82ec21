"""One Generate call per generation (``generate_mux = false``): the other way the gateway runs
generations on the inference service.

The edge: the ``Generations`` of ``services/gateway/interfaces.py``, each generation its own
HTTP/2 stream, which an L7 balancer (a mesh sidecar) can send to any replica behind one address.
A generation reads the same events and errors as over the shared call (``generate_mux_client.py``).
"""

from __future__ import annotations

import grpc
from grpc import aio

from aiserve.common.errors import Unavailable
from aiserve.v1 import inference_pb2_grpc
from services.gateway.backend_errors import downstream_error
from services.gateway.domain import GenerationEvent, GenerationRequest
from services.gateway.inference_messages import event_from_pb, request_to_pb


class GenerateCallClient:
    """Starts a ``CallGeneration`` per generation. Each call is opened in the request's
    context, so it carries the request id and trace parent."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        self._stub = stub

    def open(self, request: GenerationRequest, timeout_s: float) -> CallGeneration:
        """Start ``request``; gRPC enforces ``timeout_s`` on the call."""
        return CallGeneration(self._stub.Generate(request_to_pb(request), timeout=timeout_s))

    async def close(self) -> None:
        """Nothing is shared between generations: nothing to close."""


class CallGeneration:
    """A Generate call read like a ``MuxGeneration`` (gRPC enforces the deadline it was given)."""

    def __init__(self, call: aio.UnaryStreamCall) -> None:
        self._call = call

    async def read(self, timeout_s: float) -> GenerationEvent:
        """The next event; the call's status as the caller should see it."""
        try:
            message = await self._call.read()
        except grpc.RpcError as exc:
            raise downstream_error("inference", exc) from exc
        if message is aio.EOF:
            raise Unavailable("inference unavailable: the generation ended without a finish_reason")
        return event_from_pb(message)  # type: ignore[arg-type]

    def close(self) -> None:
        self._call.cancel()
