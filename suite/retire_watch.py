"""The runner's side of a promote: its own tokenizer and inference instances, once the gateway
routes to them no more (their version retired after a promote, or was removed), are stopped.

The suite's first version runs as the runner's children, so no other command can stop them
without the supervisor restarting them. The runner asks the gateway's Admin service for the
routes every ``interval_s`` (nothing announces a route change to it) and stops an instance
whose address it saw on a route before and sees on none now. An instance never seen on a route
is left alone: routes kept from an earlier run may name other addresses, and stopping the
suite's only model for that would be worse than an idle process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, TextIO

import grpc
from grpc import aio

from aiserve.common.config import ConfigError
from aiserve.v1 import admin_pb2, admin_pb2_grpc
from services.gateway.targets import parse_target

if TYPE_CHECKING:
    from suite.runner import Suite

INTERVAL_S = 10.0
"""How often the runner reads the routes (a retire time is 300 s by default)."""


def routed_addresses(routes: admin_pb2.RouteList) -> set[str]:
    """Every host:port a route's version names in its fixed targets (dns:/// targets name none)."""
    found: set[str] = set()
    for route in routes.routes:
        for version in route.versions:
            for target in (version.tokenizer_target, version.inference_target):
                try:
                    found.update(parse_target("target", target).addresses)
                except ConfigError:
                    continue  # not a target the runner's instances could be behind
    return found


def retired(instances: Mapping[str, str], seen: set[str], routed: Collection[str]) -> list[str]:
    """The instances (name -> address) that were on a route (``seen``, updated here) and are
    on none now."""
    gone = [name for name, address in instances.items() if address in seen and address not in routed]
    seen.update(address for address in instances.values() if address in routed)
    return gone


async def watch_retired(suite: Suite, out: TextIO, interval_s: float = INTERVAL_S) -> None:
    """Until cancelled: stop the suite's tokenizer and inference instances that left the routes."""
    seen: set[str] = set()
    key = suite.admin_key_path.read_text().strip()
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        while True:
            try:
                routes = await stub.ListRoutes(admin_pb2.ListRoutesRequest(),
                                               metadata=(("authorization", f"Bearer {key}"),), timeout=interval_s)
            except grpc.RpcError:
                routes = None  # the gateway is restarting: ask again next time
            if routes is not None:
                instances = {name: suite.config.address(name) for name in ("tokenizer", *suite.inference_names)
                             if name in suite.processes}
                for name in retired(instances, seen, routed_addresses(routes)):
                    print(f"aiserve: {name} serves a version the gateway routes to no more: stopping it",
                          file=out, flush=True)
                    await suite.shutdown_service(name)  # asked for: never restarted
            await asyncio.sleep(interval_s)  # a timer: nothing announces a route change to the runner
