"""The Admin service on the gateway's port: the fleet as the gateway sees it
(protos/aiserve/v1/admin.proto).

The edge. Every call needs the admin key (``admin_key.py``), read from its file when the call
comes, so a key written after the gateway started works. A tenant's API key is known but not
allowed (PERMISSION_DENIED); no key, or anything else, is UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from aiserve.common.context import AUTHORIZATION_KEY
from aiserve.common.errors import PermissionDenied, Unauthenticated
from aiserve.common.server import ServiceHandle
from aiserve.v1 import admin_pb2, admin_pb2_grpc, status_pb2
from services.gateway.accounting import Accounting
from services.gateway.admin_key import matches, read_admin_key
from services.gateway.backends import Backends
from services.gateway.replica import Replica
from services.gateway.replicas import State

STATUS_TIMEOUT_S = 1.0
"""Deadline of each replica's Status call in GetFleetStatus (they are asked in parallel)."""

_BEARER = "bearer "
_STATES = {State.SERVING: status_pb2.SERVING_STATE_SERVING, State.NOT_SERVING: status_pb2.SERVING_STATE_NOT_SERVING,
           State.UNREACHABLE: status_pb2.SERVING_STATE_UNREACHABLE}


def authorize(authorization: str, key_file: Path, accounting: Accounting) -> None:
    """Pass the admin key; PERMISSION_DENIED for a tenant's key; UNAUTHENTICATED otherwise."""
    given = authorization[len(_BEARER):].strip() if authorization.lower().startswith(_BEARER) else ""
    key = read_admin_key(key_file)
    if given and key is not None and matches(given, key):
        return
    if given and accounting.keys.authenticate(given) is not None:
        raise PermissionDenied("authorization: a tenant's API key may not call the Admin service")
    if key is None:
        raise Unauthenticated(f"authorization: no admin key is configured (no well-formed key in {key_file})")
    raise Unauthenticated("authorization: send the metadata 'authorization: Bearer <admin key>'")


async def replica_status(route: str, replica: Replica[Any]) -> status_pb2.ServiceStatus:
    """``replica`` as its watch sees it, with its own Status figures when it answers now."""
    state = _STATES[replica.state]
    if replica.state is State.SERVING and not replica.is_usable:
        state = status_pb2.SERVING_STATE_NOT_SERVING  # refused by the pairing check
    report = status_pb2.ServiceStatus()
    reason = replica.reason
    if replica.state is not State.UNREACHABLE:
        try:
            report = await replica.status(STATUS_TIMEOUT_S)
        except grpc.RpcError as exc:  # gone since its watch last heard from it, or too slow to answer
            code = exc.code()  # type: ignore[attr-defined]
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                state, reason = status_pb2.SERVING_STATE_UNREACHABLE, f"Status: {code.name}: {exc.details()}"  # type: ignore[attr-defined]
    report.service, report.address, report.route = replica.service, replica.address, route
    report.state, report.reason = state, reason
    return report


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """GetFleetStatus: the gateway's own status and every backend replica's."""

    def __init__(self, key_file: Path, handle: ServiceHandle, backends: Backends, accounting: Accounting) -> None:
        self._key_file, self._handle = key_file, handle
        self._backends, self._accounting = backends, accounting

    async def GetFleetStatus(  # noqa: N802 - gRPC method name
        self, request: admin_pb2.FleetStatusRequest, context: aio.ServicerContext
    ) -> admin_pb2.FleetStatus:
        authorization = next((str(v) for k, v in context.invocation_metadata() or () if k == AUTHORIZATION_KEY), "")
        authorize(authorization, self._key_file, self._accounting)
        backends = await asyncio.gather(*(replica_status(route, r) for route, r in self._backends.replicas()))
        return admin_pb2.FleetStatus(gateway=self._handle.status(), backends=backends)


def add_admin(handle: ServiceHandle, key_file: Path, backends: Backends, accounting: Accounting) -> None:
    """Serve Admin on the gateway's server (``handle``)."""
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(key_file, handle, backends, accounting), handle.server)
