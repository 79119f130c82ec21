"""``aiserve rollout``: a route's versions, their weights and figures, and the operator's moves.

    aiserve rollout list                      # every route's versions, one line each
    aiserve rollout status [--route NAME]     # stable and canary side by side, with their figures
    aiserve rollout weight N [--canary M]     # the canary at N of 100, the stable version at 100 - N
    aiserve rollout promote [--canary M]      # the canary becomes the stable version
    aiserve rollout rollback [--reason TEXT]  # every canary of the route to weight 0

Each calls the gateway's Admin service (docs/rollouts.md) with the admin key, as ``aiserve
status`` does (``--admin-key``, else ``$AISERVE_HOME/admin.key``). ``--route`` defaults to the
only route; ``--json`` prints JSON. A change prints the route as it is after it. Exit 0 when
done, 1 when the gateway cannot be reached or fails, 2 on usage errors: bad arguments, no admin
key or one the gateway refuses, no such route or canary, or a change the gateway refuses
(INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION). Plain rows and formatting live in
``suite/rollout_view.py``; protobuf stays here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from google.protobuf.message import Message
from grpc import aio

from aiserve.common.paths import aiserve_home
from aiserve.v1 import admin_pb2, admin_pb2_grpc
from suite.rollout_start import add_start_command
from suite.rollout_view import (
    CANARY,
    RETIRING,
    STABLE,
    RouteRow,
    UsageError,
    VersionRow,
    format_list,
    format_status,
    pick_canary,
    pick_route,
    to_json,
    weights_for,
)
from suite.status import REFUSED, STATE_NAMES, admin_key_of
from suite.version_instances import stop_unrouted

ROLES = {admin_pb2.VERSION_ROLE_STABLE: STABLE, admin_pb2.VERSION_ROLE_CANARY: CANARY,
         admin_pb2.VERSION_ROLE_RETIRING: RETIRING}
STICKINESS = {admin_pb2.STICKINESS_NONE: "none", admin_pb2.STICKINESS_TENANT: "tenant",
              admin_pb2.STICKINESS_SESSION: "session"}
REJECTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ALREADY_EXISTS)
"""The gateway's answers to a change it will not make: the operator's to fix (exit 2)."""
DEFAULT_REASON = "rolled back by an operator (aiserve rollout rollback)"


def route_row(route: admin_pb2.Route) -> RouteRow:
    """A Route message as plain rows."""
    return RouteRow(route.name, STICKINESS.get(route.stickiness, "unspecified"),
                    tuple(_version_row(v) for v in route.versions))


def _version_row(v: admin_pb2.RouteVersion) -> VersionRow:
    f = v.figures
    return VersionRow(v.model, ROLES.get(v.role, "unspecified"), v.weight, STATE_NAMES.get(v.state, "UNKNOWN"),
                      v.reason, v.rolled_back_reason, v.retire_at_unix_s, v.tokenizer_target, v.inference_target,
                      f.window_s, f.requests, f.error_rate, f.ttft_p50_ms, f.ttft_p95_ms, f.tpot_p50_ms,
                      f.tpot_p95_ms, f.cache_hit_rate, f.mean_cost_micros, f.negative_feedback_rate)


class Admin:
    """The gateway's Admin rpcs over one channel, each with the admin key and a deadline."""

    def __init__(self, channel: aio.Channel, admin_key: str, timeout_s: float) -> None:
        self.stub = admin_pb2_grpc.AdminStub(channel)
        self.metadata = (("authorization", f"Bearer {admin_key}"),)
        self.timeout_s = timeout_s

    async def routes(self) -> list[RouteRow]:
        reply: admin_pb2.RouteList = await self.stub.ListRoutes(
            admin_pb2.ListRoutesRequest(), metadata=self.metadata, timeout=self.timeout_s)
        return [route_row(route) for route in reply.routes]

    async def change(self, rpc: Callable[..., Awaitable[admin_pb2.Route]], request: Message) -> RouteRow:
        """A routes rpc of ``self.stub`` (SetWeights, Promote, Rollback): the route after the change."""
        return route_row(await rpc(request, metadata=self.metadata, timeout=self.timeout_s))


async def run_action(args: argparse.Namespace, admin: Admin) -> str:
    """Do ``args.action``; return what to print."""
    routes = await admin.routes()
    if args.action == "list":
        return to_json(routes) if args.json else format_list(routes)
    route = pick_route(routes, args.route)
    if args.action == "weight":
        canary = pick_canary(route, args.canary)
        weights = weights_for(route, canary, args.percent)
        route = await admin.change(admin.stub.SetWeights, admin_pb2.SetWeightsRequest(name=route.name, weights=weights))
    elif args.action == "promote":
        canary = pick_canary(route, args.canary)
        route = await admin.change(admin.stub.Promote, admin_pb2.PromoteRequest(model=canary.model,
                                                                        retire_after_s=args.retire_after))
    elif args.action == "rollback":
        route = await admin.change(admin.stub.Rollback, admin_pb2.RollbackRequest(name=route.name, reason=args.reason))
    return to_json([route]) if args.json else format_status(route, time.time())


async def _run(args: argparse.Namespace, admin_key: str) -> str:
    async with aio.insecure_channel(args.address) as channel:
        admin = Admin(channel, admin_key, args.timeout)
        text = await run_action(args, admin)
        # Versions that a rollout started and the gateway no longer routes to (retired after a
        # promote, or removed) are stopped here: their memory is the next version's.
        routed = {v.model for route in await admin.routes() for v in route.versions}
        home = (Path(args.home) if args.home else aiserve_home()).resolve()
        stopped = await asyncio.to_thread(stop_unrouted, home, routed)
    return text + "".join(f"\nstopped {model}: it is on no route any more" for model in stopped)


def cmd_rollout(args: argparse.Namespace) -> int:
    """``aiserve rollout ...``: exit 0 done, 1 the gateway is unreachable or failed, 2 usage error."""
    if not (key := admin_key_of(args)):
        return 2
    try:
        print(asyncio.run(_run(args, key)))
    except UsageError as exc:
        print(f"aiserve: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        if code in REFUSED:
            print(f"aiserve: the gateway at {args.address} refused the admin key: {details}", file=sys.stderr)
            return 2
        print(f"aiserve: rollout {args.action}: the gateway at {args.address} answered {code.name}: {details}",
              file=sys.stderr)
        return 2 if code in REJECTED else 1
    return 0


def percent(text: str) -> int:
    """A weight out of 100, for argparse."""
    if not text.isdigit() or int(text) > 100:
        raise argparse.ArgumentTypeError(f"must be a whole number 0..100, got {text!r}")
    return int(text)


def add_rollout_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``rollout`` and its actions on the ``aiserve`` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=f"127.0.0.1:{os.environ.get('AISERVE_GATEWAY_PORT', '50051')}",
                        help="the gateway (default 127.0.0.1:$AISERVE_GATEWAY_PORT, else :50051)")
    common.add_argument("--admin-key", help="the admin key (default: the one in $AISERVE_HOME/admin.key)")
    common.add_argument("--home", help="state folder holding admin.key (default $AISERVE_HOME or var)")
    common.add_argument("--route", help="the route (model name); default: the only one")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each gateway call")
    rollout = sub.add_parser("rollout", help="a route's versions: weights, figures, promote, rollback")
    actions = rollout.add_subparsers(dest="action", required=True)
    add_start_command(actions, common)
    actions.add_parser("list", parents=[common], help="every route's versions")
    actions.add_parser("status", parents=[common], help="stable and canary side by side, with figures")
    weight = actions.add_parser("weight", parents=[common], help="the canary at N of 100, stable at 100 - N")
    weight.add_argument("percent", type=percent, metavar="N", help="the canary's weight, 0..100")
    promote = actions.add_parser("promote", parents=[common], help="the canary becomes the stable version")
    promote.add_argument("--retire-after", type=float, default=0.0, metavar="S",
                         help="seconds the former stable version stays loaded (0: the gateway's setting)")
    for action in (weight, promote):
        action.add_argument("--canary", help="the canary (name@version); default: the route's only canary")
    rollback = actions.add_parser("rollback", parents=[common], help="every canary of the route to weight 0")
    rollback.add_argument("--reason", default=DEFAULT_REASON, help="kept on each rolled-back version")
    rollout.set_defaults(func=cmd_rollout)
