"""The Admin service on the gateway's port: the fleet as the gateway sees it, and its model
routes (protos/aiserve/v1/admin.proto).

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
from services.gateway.admin_routes import route_to_pb
from services.gateway.backends import Backends
from services.gateway.interfaces import NoObserver, RequestObserver
from services.gateway.replica import Replica
from services.gateway.replicas import State
from services.gateway.route_table import Route

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
    """GetFleetStatus: the gateway's own status and every backend replica's; the routes rpcs:
    each change stored, then served (``routing.py``), answered with the route after it."""

    def __init__(self, key_file: Path, handle: ServiceHandle, backends: Backends, accounting: Accounting,
                 observer: RequestObserver) -> None:
        self._key_file, self._handle = key_file, handle
        self._backends, self._accounting, self._observer = backends, accounting, observer
        self._routes = backends.routes

    def _authorize(self, context: aio.ServicerContext) -> None:
        authorization = next((str(v) for k, v in context.invocation_metadata() or () if k == AUTHORIZATION_KEY), "")
        authorize(authorization, self._key_file, self._accounting)

    def _route(self, route: Route) -> admin_pb2.Route:
        return route_to_pb(route, self._routes, self._observer)

    async def GetFleetStatus(  # noqa: N802 - gRPC method name
        self, request: admin_pb2.FleetStatusRequest, context: aio.ServicerContext
    ) -> admin_pb2.FleetStatus:
        self._authorize(context)
        backends = await asyncio.gather(*(replica_status(route, r) for route, r in self._backends.replicas()))
        return admin_pb2.FleetStatus(gateway=self._handle.status(), backends=backends)

    async def ListRoutes(  # noqa: N802
        self, request: admin_pb2.ListRoutesRequest, context: aio.ServicerContext
    ) -> admin_pb2.RouteList:
        self._authorize(context)
        return admin_pb2.RouteList(routes=[self._route(r) for r in self._routes.table.routes.values()])

    async def AddVersion(  # noqa: N802
        self, request: admin_pb2.AddVersionRequest, context: aio.ServicerContext
    ) -> admin_pb2.Route:
        self._authorize(context)
        return self._route(self._routes.add_version(request.model, request.tokenizer_target,
                                                    request.inference_target, request.weight))

    async def SetWeights(  # noqa: N802
        self, request: admin_pb2.SetWeightsRequest, context: aio.ServicerContext
    ) -> admin_pb2.Route:
        self._authorize(context)
        return self._route(self._routes.set_weights(request.name, dict(request.weights)))

    async def Promote(  # noqa: N802
        self, request: admin_pb2.PromoteRequest, context: aio.ServicerContext
    ) -> admin_pb2.Route:
        self._authorize(context)
        return self._route(self._routes.promote(request.model, request.retire_after_s))

    async def Rollback(  # noqa: N802
        self, request: admin_pb2.RollbackRequest, context: aio.ServicerContext
    ) -> admin_pb2.Route:
        self._authorize(context)
        return self._route(self._routes.rollback(request.name, request.reason))

    async def RemoveVersion(  # noqa: N802
        self, request: admin_pb2.RemoveVersionRequest, context: aio.ServicerContext
    ) -> admin_pb2.Route:
        self._authorize(context)
        return self._route(self._routes.remove_version(request.model))


def add_admin(handle: ServiceHandle, key_file: Path, backends: Backends, accounting: Accounting,
              observer: RequestObserver | None = None) -> None:
    """Serve Admin on the gateway's server (``handle``); ``observer`` gives the versions' figures."""
    servicer = AdminServicer(key_file, handle, backends, accounting, observer or NoObserver())
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, handle.server)
