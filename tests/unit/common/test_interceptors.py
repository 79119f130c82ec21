"""The server interceptor over real gRPC: request ids, status mapping, and survival of bugs."""

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio

from aiserve.common.context import current_request_id
from aiserve.common.errors import InvalidArgument
from aiserve.common.server import ServiceHandle, new_server
from aiserve.v1 import cache_pb2, cache_pb2_grpc


class FakeCache(cache_pb2_grpc.CacheServicer):
    async def Lookup(self, request: cache_pb2.LookupRequest, context: aio.ServicerContext) -> cache_pb2.LookupResponse:  # noqa: N802
        if request.prompt == "bad":
            raise InvalidArgument("prompt: must not be 'bad'")
        if request.prompt == "bug":
            raise RuntimeError("boom")
        return cache_pb2.LookupResponse(entry_id=current_request_id())


@pytest.fixture
async def server() -> AsyncIterator[ServiceHandle]:
    handle = new_server("test", ["aiserve.v1.Cache"], "127.0.0.1", 0)
    cache_pb2_grpc.add_CacheServicer_to_server(FakeCache(), handle.server)
    await handle.start()
    try:
        yield handle
    finally:
        await handle.stop(0)


async def _lookup(handle: ServiceHandle, prompt: str, metadata: tuple = ()) -> tuple[cache_pb2.LookupResponse, aio.Metadata]:
    async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        call = cache_pb2_grpc.CacheStub(channel).Lookup(cache_pb2.LookupRequest(prompt=prompt), metadata=metadata, timeout=5)
        reply = await call
        return reply, await call.initial_metadata()


async def test_request_id_is_taken_bound_and_echoed(server: ServiceHandle) -> None:
    reply, metadata = await _lookup(server, "ok", (("x-request-id", "abc-123"),))
    assert reply.entry_id == "abc-123"  # the handler saw it through the ContextVar
    assert dict(metadata)["x-request-id"] == "abc-123"


async def test_request_id_is_minted_when_absent(server: ServiceHandle) -> None:
    reply, metadata = await _lookup(server, "ok")
    assert len(reply.entry_id) == 32 and dict(metadata)["x-request-id"] == reply.entry_id


async def test_malformed_request_id_is_invalid_argument(server: ServiceHandle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await _lookup(server, "ok", (("x-request-id", "has space"),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-request-id" in info.value.details()


async def test_api_error_keeps_its_code_and_a_bug_is_internal_with_the_id(server: ServiceHandle) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await _lookup(server, "bad")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        await _lookup(server, "bug", (("x-request-id", "bug-1"),))
    assert info.value.code() == grpc.StatusCode.INTERNAL and "bug-1" in info.value.details()
    reply, _ = await _lookup(server, "ok")  # still serving
    assert reply.entry_id
