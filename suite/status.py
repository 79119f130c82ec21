"""``aiserve status``: the fleet as its gateway sees it, as one table or as JSON.

It calls ``aiserve.v1.Admin/GetFleetStatus`` on the gateway with the admin key (``--admin-key``,
else ``$AISERVE_HOME/admin.key``, which the local suite writes) and prints the gateway, then every
backend replica: route, address, state (and why, when not SERVING), model, queue, running, KV
cache used/total, RSS and uptime. Exit 0 when everything is SERVING, 1 when something is not or
the gateway cannot be reached, 2 on usage errors (no admin key, or the gateway refuses it).
The table is made by a pure function (``format_table``) from plain rows (``Row``); protobuf
stays in ``rows_from`` and ``fetch_fleet``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio

from aiserve.common.paths import ADMIN_KEY_FILE, aiserve_home
from aiserve.v1 import admin_pb2, admin_pb2_grpc, status_pb2
from services.gateway.admin_key import read_admin_key

SERVING = "SERVING"
STATE_NAMES = {
    status_pb2.SERVING_STATE_SERVING: SERVING,
    status_pb2.SERVING_STATE_NOT_SERVING: "NOT_SERVING",
    status_pb2.SERVING_STATE_UNREACHABLE: "UNREACHABLE",
}
HEADER = ("SERVICE", "ROUTE", "ADDRESS", "STATE", "MODEL", "QUEUE", "RUNNING", "KV USED/TOTAL", "RSS", "UPTIME")
NUMERIC = {"QUEUE", "RUNNING", "RSS", "UPTIME"}
"""Columns aligned to the right."""
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclass(frozen=True)
class Row:
    """One service instance as the gateway reports it (bytes and seconds as numbers)."""

    service: str
    route: str
    address: str
    state: str
    reason: str
    model: str
    queue_length: int
    running: int
    kv_used_bytes: int
    kv_total_bytes: int
    rss_bytes: int
    uptime_s: float


def rows_from(fleet: admin_pb2.FleetStatus) -> list[Row]:
    """The gateway first, then the backends in the gateway's order (route, service, address)."""
    return [_row(status) for status in (fleet.gateway, *fleet.backends)]


def _row(status: status_pb2.ServiceStatus) -> Row:
    return Row(status.service, status.route, status.address, STATE_NAMES.get(status.state, "UNKNOWN"),
               status.reason, status.model, status.queue_length, status.running, status.kv_used_bytes,
               status.kv_total_bytes, status.rss_bytes, status.uptime_s)


def all_serving(rows: Sequence[Row]) -> bool:
    return bool(rows) and all(row.state == SERVING for row in rows)


def format_bytes(count: int) -> str:
    """1536 -> ``1.5 KiB``; 0 (not known) -> ``-``."""
    if not count:
        return "-"
    value, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"


def format_duration(seconds: float) -> str:
    """3725 -> ``1h02m``; 0 (not known) -> ``-``."""
    if seconds <= 0:
        return "-"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _cells(row: Row) -> tuple[str, ...]:
    state = row.state if row.state == SERVING or not row.reason else f"{row.state} ({row.reason})"
    kv = f"{format_bytes(row.kv_used_bytes)}/{format_bytes(row.kv_total_bytes)}" if row.kv_total_bytes else "-"
    return (row.service, row.route or "-", row.address or "-", state, row.model or "-", str(row.queue_length),
            str(row.running), kv, format_bytes(row.rss_bytes), format_duration(row.uptime_s))


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table with a header line (no trailing spaces)."""
    table = [HEADER, *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]
    lines = []
    for line in table:
        cells = [cell.rjust(w) if HEADER[i] in NUMERIC else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(line, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def to_json(rows: Sequence[Row]) -> str:
    """The same rows as JSON: ``{"serving": bool, "services": [row, ...]}``."""
    return json.dumps({"serving": all_serving(rows), "services": [dataclasses.asdict(row) for row in rows]},
                      indent=2)


async def fetch_fleet(address: str, admin_key: str, timeout_s: float) -> admin_pb2.FleetStatus:
    """The gateway's ``GetFleetStatus`` answer."""
    async with aio.insecure_channel(address) as channel:
        reply: admin_pb2.FleetStatus = await admin_pb2_grpc.AdminStub(channel).GetFleetStatus(
            admin_pb2.FleetStatusRequest(), metadata=(("authorization", f"Bearer {admin_key}"),), timeout=timeout_s)
    return reply


def admin_key_of(args: argparse.Namespace) -> str | None:
    """The admin key: ``--admin-key``, else the one in ``--home`` (or $AISERVE_HOME)/admin.key;
    None, said on stderr, when there is none."""
    key_file = (Path(args.home) if args.home else aiserve_home()) / ADMIN_KEY_FILE
    key = args.admin_key or read_admin_key(key_file)
    if not key:
        print(f"aiserve: no admin key: pass --admin-key or start the suite (it writes {key_file})", file=sys.stderr)
    return key


def cmd_status(args: argparse.Namespace) -> int:
    """``aiserve status [--json]``: exit 0 all SERVING, 1 not (or unreachable), 2 usage error."""
    if not (key := admin_key_of(args)):
        return 2
    try:
        fleet = asyncio.run(fetch_fleet(args.address, key, args.timeout))
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        if code in REFUSED:
            print(f"aiserve: the gateway at {args.address} refused the admin key: {details}", file=sys.stderr)
            return 2
        print(f"aiserve: cannot get the fleet status from the gateway at {args.address}: "
              f"{code.name}: {details}", file=sys.stderr)
        return 1
    rows = rows_from(fleet)
    print(to_json(rows) if args.json else format_table(rows))
    return 0 if all_serving(rows) else 1


def add_status_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``status`` on the ``aiserve`` parser."""
    status = sub.add_parser("status", help="the fleet as the gateway sees it (exit 0: all SERVING)")
    status.add_argument("--address", default=f"127.0.0.1:{os.environ.get('AISERVE_GATEWAY_PORT', '50051')}",
                        help="the gateway (default 127.0.0.1:$AISERVE_GATEWAY_PORT, else :50051)")
    status.add_argument("--admin-key", help="the admin key (default: the one in $AISERVE_HOME/admin.key)")
    status.add_argument("--home", help="state folder holding admin.key (default $AISERVE_HOME or var)")
    status.add_argument("--json", action="store_true", help="print JSON instead of the table")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the gateway")
    status.set_defaults(func=cmd_status)
