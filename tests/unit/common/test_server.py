"""Server plumbing: the port announcement a runner reads to learn where a service listens,
and health and Status telling the same state with its reason."""

from __future__ import annotations

import asyncio
import os

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.common.server import ServiceHandle, announce_port, new_server
from aiserve.v1 import status_pb2, status_pb2_grpc


def test_announce_port_writes_one_line_and_closes_the_descriptor() -> None:
    read_fd, write_fd = os.pipe()
    try:
        announce_port(write_fd, 50123)
        with pytest.raises(OSError):
            os.fstat(write_fd)  # closed: the reader sees end-of-file after the line
        assert os.read(read_fd, 100) == b"50123\n"
        assert os.read(read_fd, 100) == b""
    finally:
        os.close(read_fd)


def test_no_descriptor_no_announcement() -> None:
    announce_port(-1, 50123)  # nothing to write to, nothing raised


async def _report(handle: ServiceHandle) -> tuple[int, status_pb2.ServiceStatus]:
    async with aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        report = await status_pb2_grpc.StatusStub(channel).GetStatus(status_pb2.StatusRequest(), timeout=5)
        return health.status, report


async def test_health_and_status_tell_the_same_state_and_the_reason() -> None:
    handle = new_server("probe-test", [], "127.0.0.1", 0)
    handle.figures = lambda: status_pb2.ServiceStatus(model="m@1", queue_length=3)
    await handle.start()
    try:
        status, report = await _report(handle)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (report.state, report.reason) == (status_pb2.SERVING_STATE_NOT_SERVING, "starting")
        await handle.begin_serving()  # no health loop: SERVING from here on
        status, report = await _report(handle)
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert (report.service, report.state, report.reason) == ("probe-test", status_pb2.SERVING_STATE_SERVING, "")
        assert (report.model, report.queue_length) == ("m@1", 3)  # the service's own figures
        assert report.rss_bytes > 0 and report.uptime_s >= 0
        await handle.set_serving(False, "probe failed: boom")
        status, report = await _report(handle)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING and report.reason == "probe failed: boom"
        assert handle.registry.get_sample_value("aiserve_serving") == 0
    finally:
        await handle.stop(0)


async def test_a_health_loop_owns_the_status_until_stopping() -> None:
    handle = new_server("loop-test", [], "127.0.0.1", 0)
    ran, stopped = asyncio.Event(), asyncio.Event()

    async def health_loop() -> None:
        await handle.set_serving(True)
        ran.set()
        try:
            await asyncio.Event().wait()  # runs until cancelled by stop()
        finally:
            stopped.set()

    handle.health_loop = health_loop
    await handle.start()
    await handle.begin_serving()
    await asyncio.wait_for(ran.wait(), 5)
    assert handle.is_serving and handle.registry.get_sample_value("aiserve_serving") == 1
    await handle.stop(0)
    assert stopped.is_set()
    assert (handle.is_serving, handle.reason) == (False, "draining")
    await handle.set_serving(True)  # a late report cannot revive a stopping server
    assert not handle.is_serving


async def test_every_server_exports_the_process_collector_in_its_own_registry() -> None:
    """Each service builds its server with new_server: its scrape carries the process's figures."""
    handles = [new_server(name, [], "127.0.0.1", 0) for name in ("one", "two")]
    try:
        for handle in handles:
            assert (handle.registry.get_sample_value("process_resident_memory_bytes") or 0) > 0
            assert handle.registry.get_sample_value("process_cpu_seconds_total") is not None
            assert (handle.registry.get_sample_value("process_open_fds") or 0) > 0
    finally:
        for handle in handles:
            await handle.stop(0)
