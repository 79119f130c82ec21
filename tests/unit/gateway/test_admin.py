"""The Admin service on the gateway's port, over real gRPC: only the admin key passes (read when
the call comes), and GetFleetStatus lists every replica with its watch's state and reason and
its own Status figures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from aiserve.v1 import admin_pb2, admin_pb2_grpc, status_pb2
from services.gateway.admin_key import ensure_admin_key
from services.gateway.replicas import State
from tests.unit.gateway.server_fakes import MODEL
from tests.unit.gateway.test_fleet import TIMEOUT_S, Fleet, start_fleet, stop_fleet


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    started = await start_fleet(tmp_path)
    try:
        yield started
    finally:
        await stop_fleet(started)


async def fleet_status(fleet: Fleet, authorization: str | None) -> admin_pb2.FleetStatus:
    metadata = (("authorization", authorization),) if authorization is not None else ()
    async with aio.insecure_channel(fleet.address) as channel:
        return await admin_pb2_grpc.AdminStub(channel).GetFleetStatus(  # type: ignore[no-any-return]
            admin_pb2.FleetStatusRequest(), metadata=metadata, timeout=TIMEOUT_S)


async def refused(fleet: Fleet, authorization: str | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        await fleet_status(fleet, authorization)
    return info.value


async def test_the_admin_key_sees_every_replica_with_its_state_and_reason(fleet: Fleet, tmp_path: Path) -> None:
    key = ensure_admin_key(tmp_path / "admin.key")  # written after the gateway started: read per call
    await fleet.inference[0].set_serving(False, "maintenance")
    await fleet.inference[1].server.stop(None)
    await fleet.until(lambda: fleet.state(0) is State.NOT_SERVING and fleet.state(1) is State.UNREACHABLE)
    status = await fleet_status(fleet, f"Bearer {key}")
    assert (status.gateway.service, status.gateway.state) == ("gateway", status_pb2.SERVING_STATE_NOT_SERVING)
    assert status.gateway.reason.startswith("inference: no replica SERVING")
    found = {(b.service, b.address): b for b in status.backends}
    assert sorted(found) == sorted([("inference", fleet.replica_address(0)), ("inference", fleet.replica_address(1)),
                                    ("tokenizer", f"127.0.0.1:{fleet.tokenizer.port}")])
    listed = [(b.route, b.service, b.address) for b in status.backends]
    assert listed == sorted(listed)  # by route, then service, then address
    assert {b.route for b in status.backends} == {MODEL}
    tokenizer = found["tokenizer", f"127.0.0.1:{fleet.tokenizer.port}"]
    assert (tokenizer.state, tokenizer.reason) == (status_pb2.SERVING_STATE_SERVING, "")
    assert tokenizer.uptime_s > 0 and tokenizer.rss_bytes > 0  # its own Status, asked now
    paused = found["inference", fleet.replica_address(0)]
    assert (paused.state, paused.reason) == (status_pb2.SERVING_STATE_NOT_SERVING, "maintenance")
    gone = found["inference", fleet.replica_address(1)]
    assert gone.state == status_pb2.SERVING_STATE_UNREACHABLE and "UNAVAILABLE" in gone.reason


async def test_a_tenant_key_is_denied_and_anything_else_is_unauthenticated(fleet: Fleet, tmp_path: Path) -> None:
    error = await refused(fleet, "Bearer aisadm_" + "0" * 64)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no admin key is configured" in (error.details() or "")
    ensure_admin_key(tmp_path / "admin.key")
    error = await refused(fleet, f"Bearer {fleet.keys['payer']}")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    for other in (None, "Bearer aisadm_" + "0" * 64, "Bearer nonsense"):
        error = await refused(fleet, other)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "admin key" in (error.details() or "")
