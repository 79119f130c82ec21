"""The canary judgement's place in the gateway: finished requests become a version's figures
(for Admin and the judge), and only canaries with traffic are paired with their stable version."""

from __future__ import annotations

from services.gateway.canary import WindowObserver, pairings
from services.gateway.domain import RequestOutcome
from services.gateway.route_table import Role, Route, RouteTable, Stickiness, Version
from services.gateway.version_window import VersionWindow


def test_finished_requests_become_their_versions_figures() -> None:
    now = [100.0]
    observer = WindowObserver(VersionWindow(60.0, clock=lambda: now[0]), clock=lambda: now[0])
    observer.observe(RequestOutcome("m@1", 40, 10.0, False, False, 200))
    observer.observe(RequestOutcome("m@1", 0, 0.0, True, False, 0))  # an error: no latency to count
    observer.observe(RequestOutcome("m@2", 90, 30.0, False, True, 0))
    one = observer.figures("m@1")
    assert (one.requests, one.error_rate, one.ttft_p95_ms, one.tpot_p95_ms) == (2, 0.5, 40, 10.0)
    assert one.mean_cost_micros == 100 and one.window_s == 60.0
    assert observer.figures("m@2").cache_hit_rate == 1.0
    observer.rated("m@2", negative=True)
    observer.rated("m@2", negative=False)
    assert observer.figures("m@2").negative_feedback_rate == 0.5
    now[0] += 61  # out of the window
    assert observer.figures("m@1").requests == 0


def test_only_canaries_with_traffic_are_judged_against_their_stable_version() -> None:
    route = Route("m", Stickiness.NONE, [Version("m@1", "t", "i", 90, Role.STABLE),
                                         Version("m@2", "t", "i", 10, Role.CANARY),
                                         Version("m@3", "t", "i", 0, Role.CANARY),
                                         Version("m@0", "t", "i", 0, Role.RETIRING)])
    window = VersionWindow(60.0, clock=lambda: 10.0)
    window.record("m@2", 5.0, 50, 5, False, False, 1)
    [pairing] = pairings(RouteTable([route], "m", clock=lambda: 0.0), window)
    assert (pairing.route, pairing.stable, pairing.canary) == ("m", "m@1", "m@2")
    assert pairing.canary_figures.requests == 1 and pairing.stable_figures.requests == 0
