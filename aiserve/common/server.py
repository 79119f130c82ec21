"""Server plumbing shared by the four services: health, status, reflection, metrics, graceful stop.

A service's ``create_server(config)`` calls ``new_server`` and registers its servicer; its
``main()`` calls ``serve``. Health stays NOT_SERVING until the service says it is warm; then
either it is SERVING for good, or the service's own ``health_loop`` (inference: its probe;
gateway: its backends) sets it for as long as the service runs. On SIGTERM/SIGINT it goes back
to NOT_SERVING ("draining") before in-flight RPCs get ``grace_s`` to finish. Every change is
logged with its reason and exported as ``aiserve_serving``; ``aiserve.v1.Status`` tells the
reason and the figures behind it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Gauge, GCCollector, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.registry import CollectorRegistry

from aiserve.common.interceptors import RpcMetrics, ServerInterceptor
from aiserve.common.logging import get_logger, log_startup
from aiserve.common.protocol import MAX_MESSAGE_BYTES
from aiserve.v1 import status_pb2, status_pb2_grpc

log = get_logger("server")

ConfigT = TypeVar("ConfigT")

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Permit the gateway's keepalive pings (aiserve/common/interceptors.py, every 10 s), calls or
    # not. A ping within 1 s of the last, with no data sent between them, is a strike and the
    # third strike closes the connection ("too_many_pings"); 1 s leaves a 10x margin for timers
    # that fire late on a loaded machine and still refuses a client that pings in a loop.
    # The key is grpc core's own spelling: an unknown key is ignored without a word, and one
    # misspelt ("min_recv_ping_...") once left grpc's 5-minute default in force, so every
    # keepalive on a connection the backend wrote nothing to for 40 s was a strike and the
    # gateway's channel to an idle replica was closed ("Too many pings"). Tests check every key
    # here against the grpc library (tests/unit/common/test_grpc_options.py).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 2),
]


StatusFigures = Callable[[], status_pb2.ServiceStatus]
"""A service's own figures for its Status rpc (model, queue, batch, KV); the plumbing fills in
the service name, state, reason, resident memory and uptime."""


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
    on_start: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Run once the gRPC server has started (e.g. the gateway's HTTP server begins accepting)."""
    extra_ports: tuple[int, ...] = ()
    """Other ports this service has bound (the gateway's HTTP port), announced after ``port``."""
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    on_stopping: list[Callable[[], None]] = field(default_factory=list)
    """Run when stopping begins, before in-flight RPCs get their grace period (e.g. tell
    long-lived multiplexed calls to take no new work and end)."""
    health_loop: Callable[[], Coroutine[Any, Any, None]] | None = None
    """Owns the health status from ``begin_serving`` until stopping (it calls ``set_serving``
    as long as it runs); None = SERVING from ``begin_serving`` on."""
    figures: StatusFigures | None = None
    """The service's own part of its Status rpc (None: only state, memory and uptime)."""
    is_serving: bool = False
    reason: str = "starting"
    """Why it is not SERVING ("" while it is)."""
    started_at: float = field(default_factory=time.monotonic)
    _is_stopping: bool = False
    _has_served: bool = False
    _health_task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self._serving_gauge = Gauge("aiserve_serving", "1 while grpc.health.v1 reports SERVING",
                                    registry=self.registry)

    async def set_serving(self, serving: bool, reason: str = "") -> None:
        """Report SERVING or NOT_SERVING (with ``reason``) on every health name; once stopping,
        always NOT_SERVING ("draining")."""
        if self._is_stopping:
            serving, reason = False, "draining"
        reason = "" if serving else (reason or "not serving")
        if (serving, reason) != (self.is_serving, self.reason):
            log.info("health_changed", service=self.name, serving=serving, reason=reason)
        if serving and not self._has_served:
            self._has_served = True
            log_startup("serving")
        self.is_serving, self.reason = serving, reason
        self._serving_gauge.set(1 if serving else 0)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def start(self) -> None:
        # grpc's HealthServicer reports "" as SERVING from birth; stay NOT_SERVING until warm.
        await self.set_serving(False, "starting")
        await self.server.start()
        for begin in self.on_start:
            await begin()
        self.started_at = time.monotonic()

    async def begin_serving(self) -> None:
        """The service is warm: SERVING now, or from here on whatever its ``health_loop`` says."""
        if self.health_loop is None:
            await self.set_serving(True)
        elif self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self.health_loop())

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let in-flight RPCs finish for up to ``grace_s``, release resources."""
        self._is_stopping = True
        if (task := self._health_task) is not None:
            self._health_task = None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.set_serving(False, "draining")
        for stopping in self.on_stopping:
            stopping()
        await self.server.stop(grace_s)
        for close in reversed(self.on_close):
            await close()

    def status(self) -> status_pb2.ServiceStatus:
        """This service's Status: its own figures, then state, reason, memory and uptime."""
        report = self.figures() if self.figures is not None else status_pb2.ServiceStatus()
        report.service = self.name
        report.state = status_pb2.SERVING_STATE_SERVING if self.is_serving else status_pb2.SERVING_STATE_NOT_SERVING
        report.reason = self.reason
        report.rss_bytes = rss_bytes()
        report.uptime_s = max(0.0, time.monotonic() - self.started_at)
        return report


class StatusServicer(status_pb2_grpc.StatusServicer):
    """``aiserve.v1.Status`` of one server (its ``ServiceHandle.status``)."""

    def __init__(self, handle: ServiceHandle) -> None:
        self._handle = handle

    async def GetStatus(  # noqa: N802 - gRPC method name
        self, request: status_pb2.StatusRequest, context: aio.ServicerContext
    ) -> status_pb2.ServiceStatus:
        return self._handle.status()


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def new_server(name: str, service_names: Sequence[str], host: str, port: int) -> ServiceHandle:
    """A server with the common interceptor, health (NOT_SERVING) and reflection, bound to a port.

    ``port`` 0 binds a free port; the handle's ``port`` is the one bound.
    """
    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    rpc_metrics = RpcMetrics(name, registry)
    server = aio.server(interceptors=[ServerInterceptor(rpc_metrics)], options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             status_pb2.DESCRIPTOR.services_by_name["Status"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"{name}: cannot bind {host}:{port}")
    handle = ServiceHandle(name, server, health_servicer, bound, tuple(service_names), registry, rpc_metrics)
    status_pb2_grpc.add_StatusServicer_to_server(StatusServicer(handle), server)
    return handle


def announce_port(fd: int, port: int, *extra_ports: int) -> None:
    """Write ``port`` (then any ``extra_ports``, space-separated) as one line to the file
    descriptor ``fd`` and close it (``fd`` -1: nothing).

    The suite runner passes the write end of a pipe (setting ``announce_fd``) to a service it
    starts on port 0 and reads the port the service bound from the other end; end-of-file
    without a line tells it the service exited before it listened.
    """
    if fd < 0:
        return
    try:
        os.write(fd, (" ".join(str(p) for p in (port, *extra_ports)) + "\n").encode())
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
    announce_port(announce_fd, handle.port, *handle.extra_ports)
    if warmup is not None:
        await warmup()
    await handle.begin_serving()
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
    log_startup("imported")
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
