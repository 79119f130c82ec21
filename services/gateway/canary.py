"""The canary judgement inside the gateway: every finished request goes into its version's
window (``version_window.VersionWindow``), which also answers the Admin service's figures, and
a loop judges each canary that has traffic against its route's stable version
(``canary_judge``), rolling the route back by itself when the canary is worse (docs/rollouts.md,
docs/decisions.md, decision 50)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from services.gateway.canary_judge import CanaryMetrics, JudgeConfig, Pairing, judge_loop
from services.gateway.domain import RequestOutcome, VersionFigures
from services.gateway.route_table import Role, Route, RouteTable
from services.gateway.version_window import VersionWindow


class WindowObserver:
    """The gateway's ``RequestObserver``: a window of every version's finished requests."""

    def __init__(self, window: VersionWindow, clock: Callable[[], float] = time.monotonic) -> None:
        self.window, self._clock = window, clock

    def observe(self, outcome: RequestOutcome) -> None:
        """Record one finished request (a latency of 0 means there was none to measure)."""
        self.window.record(outcome.model, self._clock(), outcome.ttft_ms or None, outcome.tpot_ms or None,
                           outcome.is_error, outcome.cache_hit, outcome.cost_micros)

    def rated(self, model: str, negative: bool) -> None:
        self.window.record_feedback(model, negative, self._clock())

    def figures(self, model: str) -> VersionFigures:
        return self.window.figures(model)


def pairings(table: RouteTable, window: VersionWindow) -> list[Pairing]:
    """Every canary with a weight above 0, with its route's stable version, and their figures."""
    found = []
    for route in table.routes.values():
        stable = route.stable
        for version in route.versions:
            if version.role is Role.CANARY and version.weight > 0:
                found.append(Pairing(route.name, stable.model, window.figures(stable.model),
                                     version.model, window.figures(version.model)))
    return found


class CanaryWatch:
    """The window, the observer over it, and the judgement loop of one gateway."""

    def __init__(self, config: JudgeConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.window = VersionWindow(config.canary_window_s)
        self.observer = WindowObserver(self.window)
        self._metrics = CanaryMetrics(registry)

    async def run(self, table: Callable[[], RouteTable], rollback: Callable[[str, str], Route]) -> None:
        """Judge until cancelled; ``table()`` is the current route table, ``rollback(route,
        reason)`` the Admin service's rollback."""
        async def read() -> list[Pairing]:
            return pairings(table(), self.window)

        async def roll_back(route: str, reason: str) -> None:
            rollback(route, reason)

        await judge_loop(self.config, read, roll_back, self._metrics.on_verdict)

