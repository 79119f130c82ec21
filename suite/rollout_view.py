"""What ``aiserve rollout`` shows and chooses, as pure functions of plain rows (no grpc, no pb).

A route's versions side by side (``format_status``: stable first, then the canaries, then the
retiring versions, one column each), every route's versions as a table (``format_list``), the
same as JSON (``to_json``), and the choices a command makes before it calls the gateway: which
route (``pick_route``), which canary (``pick_canary``) and the weights that give a canary N of
100 (``weights_for``). A choice that cannot be made raises ``UsageError`` with the reason.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

from suite.status import format_duration

STABLE, CANARY, RETIRING = "stable", "canary", "retiring"
ROLE_ORDER = {STABLE: 0, CANARY: 1, RETIRING: 2}
LIST_HEADER = ("ROUTE", "MODEL", "ROLE", "WEIGHT", "STATE", "REQUESTS", "ERRORS", "TTFT P95", "ROLLED BACK")
"""The list's columns; a rollback's reason is the last, so a long one does not widen the others."""


class UsageError(Exception):
    """The command cannot be done as asked (the message says why); exit code 2."""


@dataclass(frozen=True)
class VersionRow:
    """One version of a route with its figures over the gateway's judgement window."""

    model: str
    role: str
    weight: int
    state: str
    reason: str
    rolled_back_reason: str
    retire_at_unix_s: float
    tokenizer_target: str
    inference_target: str
    window_s: float
    requests: int
    error_rate: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    tpot_p50_ms: float
    tpot_p95_ms: float
    cache_hit_rate: float
    mean_cost_micros: float
    negative_feedback_rate: float


@dataclass(frozen=True)
class RouteRow:
    name: str
    stickiness: str
    versions: tuple[VersionRow, ...]


def pick_route(routes: Sequence[RouteRow], name: str | None) -> RouteRow:
    """The route called ``name``; with no name, the only route."""
    names = ", ".join(route.name for route in routes) or "none"
    if name is not None:
        for route in routes:
            if route.name == name:
                return route
        raise UsageError(f"the gateway has no route {name!r} (routes: {names})")
    if len(routes) != 1:
        raise UsageError(f"the gateway has {len(routes)} routes ({names}): name one with --route")
    return routes[0]


def pick_canary(route: RouteRow, model: str | None) -> VersionRow:
    """The route's canary called ``model``; with no model, its only canary."""
    canaries = [v for v in route.versions if v.role == CANARY]
    if model is not None:
        canaries = [v for v in canaries if v.model == model]
        if not canaries:
            raise UsageError(f"route {route.name!r} has no canary {model!r}")
    if not canaries:
        raise UsageError(f"route {route.name!r} has no canary: add a version first")
    if len(canaries) > 1:
        raise UsageError(f"route {route.name!r} has {len(canaries)} canaries "
                         f"({', '.join(v.model for v in canaries)}): name one with --canary")
    return canaries[0]


def stable_of(route: RouteRow) -> VersionRow:
    for version in route.versions:
        if version.role == STABLE:
            return version
    raise UsageError(f"route {route.name!r} has no stable version")


def weights_for(route: RouteRow, canary: VersionRow, percent: int) -> dict[str, int]:
    """The canary at ``percent``, the stable version at 100 - ``percent`` (others unchanged)."""
    if not 0 <= percent <= 100:
        raise UsageError(f"weight: must be 0..100, got {percent}")
    return {canary.model: percent, stable_of(route).model: 100 - percent}


def _rate(version: VersionRow, value: float) -> str:
    return f"{value:.1%}" if version.requests else "-"


def _pair_ms(version: VersionRow, p50: float, p95: float) -> str:
    return f"{p50:.0f}/{p95:.0f} ms" if version.requests else "-"


def _retires(version: VersionRow, now_unix_s: float) -> str:
    if not version.retire_at_unix_s:
        return "-"
    return f"in {format_duration(version.retire_at_unix_s - now_unix_s)}" if version.retire_at_unix_s > now_unix_s \
        else "now"


def _status_lines(v: VersionRow, now_unix_s: float) -> list[tuple[str, str]]:
    state = v.state if not v.reason else f"{v.state} ({v.reason})"
    return [
        ("model", v.model), ("weight", str(v.weight)), ("state", state), ("requests", str(v.requests)),
        ("error rate", _rate(v, v.error_rate)), ("ttft p50/p95", _pair_ms(v, v.ttft_p50_ms, v.ttft_p95_ms)),
        ("tpot p50/p95", _pair_ms(v, v.tpot_p50_ms, v.tpot_p95_ms)), ("cache hit rate", _rate(v, v.cache_hit_rate)),
        ("mean cost", f"{v.mean_cost_micros:.0f} micros" if v.requests else "-"),
        ("negative feedback", _rate(v, v.negative_feedback_rate)),
        ("rolled back", "yes (below)" if v.rolled_back_reason else "-"), ("retires", _retires(v, now_unix_s)),
    ]


def format_status(route: RouteRow, now_unix_s: float) -> str:
    """The route's versions side by side, one column each, stable first (no trailing spaces); the
    reason of each rollback on a line of its own below."""
    versions = sorted(route.versions, key=lambda v: (ROLE_ORDER.get(v.role, 3), v.model))
    window = max((v.window_s for v in versions), default=0.0)
    columns = [_status_lines(v, now_unix_s) for v in versions]
    labels = [label for label, _ in columns[0]] if columns else []
    table = [("", *(v.role.upper() for v in versions))]
    table += [(label, *(column[i][1] for column in columns)) for i, label in enumerate(labels)]
    title = f"route {route.name} (stickiness {route.stickiness}; figures over the last {window:g} s)"
    reasons = [f"{v.model} rolled back: {v.rolled_back_reason}" for v in versions if v.rolled_back_reason]
    return "\n".join([title, *align(table), *reasons])


def format_list(routes: Sequence[RouteRow]) -> str:
    """Every route's versions, one line each, under a header."""
    table = [LIST_HEADER]
    for route in routes:
        for v in sorted(route.versions, key=lambda v: (ROLE_ORDER.get(v.role, 3), v.model)):
            table.append((route.name, v.model, v.role, str(v.weight), v.state, str(v.requests),
                          _rate(v, v.error_rate), f"{v.ttft_p95_ms:.0f} ms" if v.requests else "-",
                          v.rolled_back_reason or "-"))
    return "\n".join(align(table))


def align(table: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as left-aligned columns two spaces apart, without trailing spaces."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table]


def to_json(routes: Sequence[RouteRow]) -> str:
    """``{"routes": [{"name", "stickiness", "versions": [version, ...]}, ...]}``, raw figures."""
    return json.dumps({"routes": [dataclasses.asdict(route) for route in routes]}, indent=2)
