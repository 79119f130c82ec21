"""Server plumbing shared by the four services: health, reflection, metrics, graceful stop.

A service's ``create_server(config)`` calls ``new_server`` and registers its servicer; its
``main()`` calls ``serve``. Health stays NOT_SERVING until the service says it is warm, and goes
back to NOT_SERVING on SIGTERM/SIGINT, before in-flight RPCs get ``grace_s`` to finish.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.registry import CollectorRegistry

from aiserve.common.interceptors import RpcMetrics, ServerInterceptor
from aiserve.common.logging import get_logger
from aiserve.common.protocol import MAX_MESSAGE_BYTES

log = get_logger("server")

ConfigT = TypeVar("ConfigT")

_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


@dataclass
class ServiceHandle:
    """A built (not yet started) gRPC server with its health servicer and bound port."""

    name: str
    server: aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]
    registry: CollectorRegistry
    """This server's Prometheus metrics (its RPCs, its service's own collectors, the process);
    each server owns one, so two servers in one process never share or rebind a metric."""
    rpc_metrics: RpcMetrics
    """``aiserve_rpc_*`` of this server (the interceptor's; multiplexed calls count streams)."""
    servicer: object | None = None
    """The service's own servicer, once registered (tests look inside it)."""
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    on_stopping: list[Callable[[], None]] = field(default_factory=list)
    """Run when stopping begins, before in-flight RPCs get their grace period (e.g. tell
    long-lived multiplexed calls to take no new work and end)."""

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def start(self) -> None:
        # grpc's HealthServicer reports "" as SERVING from birth; stay NOT_SERVING until warm.
        await self.set_serving(False)
        await self.server.start()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight RPCs finish for up to ``grace_s``, release resources."""
        await self.set_serving(False)
        for stopping in self.on_stopping:
            stopping()
        await self.server.stop(grace_s)
        for close in reversed(self.on_close):
            await close()


def new_server(name: str, service_names: Sequence[str], host: str, port: int) -> ServiceHandle:
    """A server with the common interceptor, health (NOT_SERVING) and reflection, bound to a port.

    ``port`` 0 binds a free port; the handle's ``port`` is the one bound.
    """
    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    rpc_metrics = RpcMetrics(name, registry)
    server = aio.server(interceptors=[ServerInterceptor(rpc_metrics)], options=_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"{name}: cannot bind {host}:{port}")
    return ServiceHandle(name, server, health_servicer, bound, tuple(service_names), registry, rpc_metrics)


def announce_port(fd: int, port: int) -> None:
    """Write ``port`` as one line to the file descriptor ``fd`` and close it (``fd`` -1: nothing).

    The suite runner passes the write end of a pipe (setting ``announce_fd``) to a service it
    starts on port 0 and reads the port the service bound from the other end; end-of-file
    without a line tells it the service exited before it listened.
    """
    if fd < 0:
        return
    try:
        os.write(fd, f"{port}\n".encode())
    finally:
        os.close(fd)


def start_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
    """A server's Prometheus metrics over HTTP (port 0 = disabled)."""
    if port:
        start_http_server(port, addr=host, registry=registry)


async def serve(
    handle: ServiceHandle,
    grace_s: float,
    warmup: Callable[[], Awaitable[None]] | None = None,
    announce_fd: int = -1,
) -> None:
    """Start, announce the bound port (``announce_port``), warm up, report SERVING, and run
    until SIGTERM/SIGINT; then stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await handle.start()
    announce_port(announce_fd, handle.port)
    if warmup is not None:
        await warmup()
    await handle.set_serving(True)
    log.info("serving", service=handle.name, port=handle.port)
    await stop.wait()
    log.info("stopping", service=handle.name, grace_s=grace_s)
    await handle.stop(grace_s)
    log.info("stopped", service=handle.name)


async def wait_for_serving(address: str, timeout_s: float, service: str = "") -> None:
    """Block until ``address`` reports SERVING (uses Health.Watch: no polling with sleeps)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f}s")
            try:
                call = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=remaining,
                                  wait_for_ready=True)
                async for reply in call:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                    raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f}s") from exc
                # Server went away mid-watch (restart): wait_for_ready makes the next try block.
                await asyncio.wait_for(channel.channel_ready(), timeout=max(remaining, 0.01))


def run_service(
    name: str,
    config_cls: type[ConfigT],
    create: Callable[[ConfigT], Awaitable[ServiceHandle]],
    argv: Sequence[str] | None = None,
    prepare: Callable[[ConfigT], None] | None = None,
) -> None:
    """The ``main()`` every service shares: settings, JSON logging, ``prepare`` (e.g. torch
    threads), metrics, then serve (announcing the bound port to ``announce_fd``) until
    SIGTERM/SIGINT. Bad settings or a model the store refuses end the process with one clear
    line on stderr and exit code 2."""
    from aiserve.common.config import ConfigError, load_config
    from aiserve.common.logging import configure_logging
    from aiserve.common.progress import quiet_library_bars
    from aiserve.store import ModelStoreError

    quiet_library_bars()  # the log is JSON lines: no library progress bars in it
    try:
        config = load_config(config_cls, name, sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"aiserve-{name}: bad settings: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(name, config.log_level)  # type: ignore[attr-defined]
    if prepare is not None:
        prepare(config)

    async def run() -> None:
        handle = await create(config)
        start_metrics(handle.registry, config.metrics_port, config.host)  # type: ignore[attr-defined]
        await serve(handle, config.grace_s, announce_fd=config.announce_fd)  # type: ignore[attr-defined]

    try:
        asyncio.run(run())
    except ModelStoreError as exc:
        print(f"aiserve-{name}: cannot load the model: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
