"""The cache service in-process over real gRPC (port 0), with a deadline on every call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from aiserve.common.server import ServiceHandle
from aiserve.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.cache.config import CacheConfig
from services.cache.server import create_server

TIMEOUT_S = 5.0
SCOPE = cache_pb2.CacheScope(model="smollm2-135m-instruct@0.1.2", tenant="acme", params="t=0")


@pytest.fixture
async def handle(tmp_path: Path) -> AsyncIterator[ServiceHandle]:
    config = CacheConfig(port=0, metrics_port=0, db_path=str(tmp_path / "cache.sqlite3"))
    handle = await create_server(config)
    try:
        await handle.start()
        yield handle
    finally:
        await handle.stop(0)


@pytest.fixture
async def stub(handle: ServiceHandle) -> AsyncIterator[cache_pb2_grpc.CacheStub]:
    async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        yield cache_pb2_grpc.CacheStub(channel)


async def test_store_then_lookup_hits_exactly(stub: cache_pb2_grpc.CacheStub) -> None:
    stored = await stub.Store(cache_pb2.StoreRequest(
        scope=SCOPE, prompt="Hello?", text="Hi there.", token_ids=[12, 7, 2],
        finish_reason=common_pb2.FINISH_REASON_STOP), timeout=TIMEOUT_S)
    assert stored.entry_id

    reply = await stub.Lookup(cache_pb2.LookupRequest(scope=SCOPE, prompt="Hello?"), timeout=TIMEOUT_S)
    assert reply.hit
    assert reply.similarity == 1.0
    assert (reply.text, list(reply.token_ids)) == ("Hi there.", [12, 7, 2])
    assert reply.finish_reason == common_pb2.FINISH_REASON_STOP
    assert reply.entry_id == stored.entry_id

    other_tenant = cache_pb2.CacheScope(model=SCOPE.model, tenant="globex", params=SCOPE.params)
    miss = await stub.Lookup(cache_pb2.LookupRequest(scope=other_tenant, prompt="Hello?"),
                             timeout=TIMEOUT_S)
    assert not miss.hit
    assert (miss.text, miss.entry_id, miss.similarity) == ("", "", 0.0)


async def test_request_id_is_echoed_in_initial_metadata(stub: cache_pb2_grpc.CacheStub) -> None:
    call = stub.Lookup(cache_pb2.LookupRequest(scope=SCOPE, prompt="Hello?"),
                       metadata=(("x-request-id", "req-cache-1"),), timeout=TIMEOUT_S)
    assert not (await call).hit
    metadata = await call.initial_metadata()
    assert metadata.get("x-request-id") == "req-cache-1"


@pytest.mark.parametrize("request_", [
    cache_pb2.LookupRequest(scope=SCOPE, prompt=""),
    cache_pb2.StoreRequest(scope=SCOPE, prompt="", text="x", finish_reason=common_pb2.FINISH_REASON_STOP),
])
async def test_empty_prompt_is_invalid_argument(
    stub: cache_pb2_grpc.CacheStub, request_: cache_pb2.LookupRequest | cache_pb2.StoreRequest
) -> None:
    method = stub.Lookup if isinstance(request_, cache_pb2.LookupRequest) else stub.Store
    with pytest.raises(grpc.RpcError) as info:
        await method(request_, timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in info.value.details()


async def test_cancelled_answers_are_not_stored(stub: cache_pb2_grpc.CacheStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        await stub.Store(cache_pb2.StoreRequest(
            scope=SCOPE, prompt="Hello?", text="Hi", finish_reason=common_pb2.FINISH_REASON_CANCELLED),
            timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reply = await stub.Lookup(cache_pb2.LookupRequest(scope=SCOPE, prompt="Hello?"), timeout=TIMEOUT_S)
    assert not reply.hit


async def test_entries_survive_a_server_restart(tmp_path: Path) -> None:
    config = CacheConfig(port=0, metrics_port=0, db_path=str(tmp_path / "cache.sqlite3"))
    request = cache_pb2.StoreRequest(scope=SCOPE, prompt="Hello?", text="Hi", token_ids=[1],
                                     finish_reason=common_pb2.FINISH_REASON_LENGTH)
    for round_ in range(2):
        handle = await create_server(config)
        try:
            await handle.start()
            async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                stub = cache_pb2_grpc.CacheStub(channel)
                if round_ == 0:
                    await stub.Store(request, timeout=TIMEOUT_S)
                else:
                    reply = await stub.Lookup(cache_pb2.LookupRequest(scope=SCOPE, prompt="Hello?"),
                                              timeout=TIMEOUT_S)
                    assert reply.hit and reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            await handle.stop(0)
