"""The gRPC options our servers and channels set are ones grpc knows, and they do what we set
them for: a channel that keeps a quiet connection alive is not thrown off by the server."""

import asyncio
import functools
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.common.interceptors import DOWNSTREAM_OPTIONS
from aiserve.common.server import SERVER_OPTIONS, new_server

KEEPALIVE_MS = 1_500
"""The test channel's keepalive: well above the servers' 1 s floor, far below grpc's default 5 min."""


@functools.cache
def grpc_library() -> bytes:
    return Path(cygrpc.__file__).read_bytes()


@pytest.mark.parametrize("key", sorted({key for key, _ in (*SERVER_OPTIONS, *DOWNSTREAM_OPTIONS)}))
def test_every_option_key_is_one_grpc_core_reads(key: str) -> None:
    # grpc ignores a key it does not know without a word; its core library holds the name of
    # every key it reads as a C string.
    assert key.encode() + b"\0" in grpc_library(), f"{key}: not a key grpc {grpc.__version__} reads"


async def test_a_quiet_connection_with_keepalive_pings_stays_open() -> None:
    # A health watch that has had its answer and then hears nothing: the connection carries no
    # data, only the client's keepalive pings every 1.5 s. With grpc's default floor (5 min)
    # the third ping past the first would be the third strike and close it ("too_many_pings",
    # about 6 s in); with the servers' 1 s floor every ping is in order.
    handle = new_server("test", [], "127.0.0.1", 0)
    await handle.start()
    options = [("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.keepalive_timeout_ms", 5_000),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
               ("grpc.http2.bdp_probe", 0)]
    try:
        async with aio.insecure_channel(f"127.0.0.1:{handle.port}", options=options) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            first = await asyncio.wait_for(call.read(), 10)
            assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Five keepalive intervals of silence: the watch must still be open, with nothing to say.
            with pytest.raises(TimeoutError):
                ended = await asyncio.wait_for(call.read(), 5 * KEEPALIVE_MS / 1000)
                pytest.fail(f"the watch ended early: {ended!r}, {await call.code()}: {await call.details()}")
            call.cancel()
    finally:
        await handle.stop(0)
