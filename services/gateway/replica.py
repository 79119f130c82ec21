"""One backend replica as the gateway holds it: its address, its own channel, its own clients,
and a task that keeps a grpc.health.v1 ``Watch`` open on it.

The edge. The watch records SERVING / NOT_SERVING (with the replica's own reason from its Status
rpc) / unreachable (with the connect or call error); when the replica goes away the watch
breaks at once (its socket closes, or keepalive finds it silent) and is opened again, waiting
for the replica to come back, with a growing pause between tries. No request is ever sent just
to probe a replica. Each change calls ``on_change``, which the gateway's health and the pools'
waiting read (``pool.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.common.interceptors import downstream_channel
from aiserve.common.logging import get_logger
from aiserve.v1 import status_pb2, status_pb2_grpc
from services.gateway.replicas import State

log = get_logger("replica")

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
REASON_TIMEOUT_S = 1.0
"""Deadline of the Status call that asks a NOT_SERVING replica why."""


class Clients(Protocol):
    """A replica's own clients over its channel."""

    def reset(self) -> None:
        """The replica turned SERVING (again): forget what was checked against it."""
        ...

    async def close(self) -> None:
        ...


C = TypeVar("C", bound=Clients)


class Replica(Generic[C]):
    """One replica of ``service`` at ``address``; ``clients`` are built over its channel."""

    def __init__(self, service: str, address: str, make_clients: Callable[[aio.Channel], C],
                 on_change: Callable[[], None]) -> None:
        self.service, self.address = service, address
        self.channel = downstream_channel(address)
        self.clients = make_clients(self.channel)
        self.state = State.UNREACHABLE
        self.health_reason = "connecting"
        self.has_answered = False
        """Whether the watch has had an answer or an error yet (a new replica has not)."""
        self._mismatch, self._mismatch_until = "", 0.0
        self._on_change = on_change
        empty = contextvars.Context()  # the watch belongs to no request
        self._task = asyncio.get_running_loop().create_task(self._watch(), context=empty)

    @property
    def is_usable(self) -> bool:
        """SERVING, and not refused by a recent pairing check."""
        return self.state is State.SERVING and not self._is_mismatched()

    @property
    def reason(self) -> str:
        """Why it is not usable ("" when it is)."""
        if self.state is not State.SERVING:
            return self.health_reason
        return self._mismatch if self._is_mismatched() else ""

    def _is_mismatched(self) -> bool:
        return bool(self._mismatch) and time.monotonic() < self._mismatch_until

    def mark_mismatch(self, reason: str, for_s: float) -> None:
        """The pairing check refused this replica: not picked for ``for_s`` seconds (then it is
        checked again), nor before it turns SERVING anew."""
        self._mismatch, self._mismatch_until = reason, time.monotonic() + max(for_s, 1.0)
        log.warning("replica_refused", service=self.service, address=self.address, reason=reason)
        self._on_change()

    async def status(self, timeout_s: float) -> status_pb2.ServiceStatus:
        """The replica's own Status, asked now (raises grpc.RpcError when it does not answer)."""
        stub = status_pb2_grpc.StatusStub(self.channel)
        return await stub.GetStatus(status_pb2.StatusRequest(), timeout=timeout_s)  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Stop watching, close its clients (their shared calls), then its channel."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.clients.close()
        await self.channel.close()

    def _set(self, state: State, reason: str) -> None:
        self.has_answered = True
        if (state, reason) == (self.state, self.health_reason):
            return
        if state is State.SERVING:
            self._mismatch = ""  # a replica that (re)started is checked again
            self.clients.reset()
        log.info("replica_changed", service=self.service, address=self.address, state=state.value, reason=reason)
        self.state, self.health_reason = state, reason
        self._on_change()

    async def _watch(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        pause, wait_for_ready = BACKOFF_MIN_S, False
        while True:
            try:
                call = stub.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=wait_for_ready)
                async for reply in call:
                    pause = BACKOFF_MIN_S
                    await self._record(reply.status)
                self._set(State.UNREACHABLE, "its health watch ended")
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                self._set(State.UNREACHABLE, f"{code.name}: {exc.details() or code.name}")  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - the watch must outlive anything a call throws
                log.exception("replica_watch_failed", service=self.service, address=self.address)
                self._set(State.UNREACHABLE, f"its health watch failed: {type(exc).__name__}: {exc}")
            # Then wait for it to come back (wait_for_ready), a growing pause between tries.
            await asyncio.sleep(pause)
            pause, wait_for_ready = min(pause * 2, BACKOFF_MAX_S), True

    async def _record(self, status: int) -> None:
        if status == health_pb2.HealthCheckResponse.SERVING:
            self._set(State.SERVING, "")
        elif status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            self._set(State.NOT_SERVING, "its health service does not know the service")
        else:
            self._set(State.NOT_SERVING, await self._not_serving_reason())

    async def _not_serving_reason(self) -> str:
        try:
            report = await self.status(REASON_TIMEOUT_S)
        except grpc.RpcError:
            return "not serving"
        return report.reason or "not serving"
