"""The route table (pure): which version serves a request (weights, stickiness, pins, health),
and the admin changes with their refusals, on plain values and an injected clock."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from aiserve.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.gateway.route_table import Role, Route, RouteTable, Stickiness, Version

STABLE, CANARY = "m@1", "m@2"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def table(stable_weight: int = 100, canary_weight: int = 0, clock: Clock | None = None) -> RouteTable:
    versions = [Version(STABLE, "tok:1", "inf:1", stable_weight, Role.STABLE),
                Version(CANARY, "tok:2", "inf:2", canary_weight, Role.CANARY)]
    return RouteTable([Route("m", Stickiness.TENANT, versions)], STABLE, clock or Clock(), random.Random(7).random)


def serving(model: str) -> bool:
    return True


def share_of_stable(routes: RouteTable, keys: list[str]) -> float:
    picks = Counter(routes.pick("m", key, serving).model for key in keys)
    return picks[STABLE] / len(keys)


def test_weights_split_a_thousand_picks_by_key_and_by_draw() -> None:
    routes = table(70, 30)
    assert 0.65 <= share_of_stable(routes, [f"tenant-{i}" for i in range(1000)]) <= 0.75
    assert 0.65 <= share_of_stable(routes, [""] * 1000) <= 0.75  # no key: a draw each
    assert share_of_stable(table(100, 0), [f"tenant-{i}" for i in range(1000)]) == 1.0


def test_the_same_key_stays_on_its_version_and_moving_weight_moves_a_proportional_share() -> None:
    routes = table(70, 30)
    keys = [f"tenant-{i}" for i in range(1000)]
    before = {key: routes.pick("m", key, serving).model for key in keys}
    assert all(routes.pick("m", key, serving).model == before[key] for key in keys)  # sticky
    routes.set_weights("m", {STABLE: 80, CANARY: 20})
    after = {key: routes.pick("m", key, serving).model for key in keys}
    moved = [key for key in keys if after[key] != before[key]]
    assert all(before[key] == CANARY and after[key] == STABLE for key in moved)  # only towards the weight
    assert 0.05 <= len(moved) / len(keys) <= 0.15  # about the 10% that moved


def test_an_empty_model_is_the_default_route_and_a_pin_goes_to_its_version() -> None:
    routes = table(100, 0)
    assert routes.pick("", "t", serving).model == STABLE
    assert routes.pick(CANARY, "t", serving).model == CANARY  # weight 0 still takes pinned requests


def test_a_model_not_on_a_route_is_not_found_naming_what_is_served() -> None:
    routes = table()
    for model in ("m@9", "other", "other@1"):
        with pytest.raises(NotFound) as info:
            routes.pick(model, "", serving)
        assert info.value.message == f"model: {model!r} is not served; available: m@1, m@2"


def test_a_version_that_does_not_serve_gets_no_unpinned_traffic() -> None:
    routes = table(50, 50)
    keys = [f"k{i}" for i in range(200)]
    assert {routes.pick("m", k, lambda model: model == CANARY).model for k in keys} == {CANARY}
    assert {routes.pick("m", k, lambda model: False).model for k in keys} == {STABLE}  # its error says why


def test_adding_a_version_makes_a_canary_or_a_new_route() -> None:
    routes = table()
    with pytest.raises(AlreadyExists):
        routes.add_version(Version(CANARY, "tok:2", "inf:2", 0, Role.CANARY), Stickiness.TENANT)
    route = routes.add_version(Version("m@3", "tok:3", "inf:3", 5, Role.STABLE), Stickiness.TENANT)
    assert [(v.model, v.weight, v.role) for v in route.versions][-1] == ("m@3", 5, Role.CANARY)
    other = routes.add_version(Version("n@1", "tok:4", "inf:4", 0, Role.CANARY), Stickiness.SESSION)
    assert (other.name, other.stickiness, other.stable.model, other.stable.weight) == ("n", Stickiness.SESSION,
                                                                                      "n@1", 100)
    assert routes.pick("n", "", serving).model == "n@1"
    with pytest.raises(InvalidArgument):
        routes.add_version(Version("m@4", "t", "i", 2_000_000, Role.CANARY), Stickiness.TENANT)


def test_set_weights_refuses_unknown_names_and_a_route_without_traffic() -> None:
    routes = table()
    with pytest.raises(NotFound):
        routes.set_weights("x", {STABLE: 1})
    with pytest.raises(NotFound):
        routes.set_weights("m", {"m@9": 1})
    with pytest.raises(InvalidArgument, match="no version of route 'm' would keep a weight above 0"):
        routes.set_weights("m", {STABLE: 0})
    route = routes.set_weights("m", {CANARY: 25})
    assert [v.weight for v in route.versions] == [100, 25]  # the stable version kept its weight


def test_promote_retires_the_former_stable_version_which_leaves_when_due() -> None:
    clock = Clock()
    routes = table(90, 10, clock)
    route = routes.promote(CANARY, 300.0)
    assert [(v.model, v.weight, v.role, v.retire_at) for v in route.versions] == [
        (STABLE, 0, Role.RETIRING, 1_300.0), (CANARY, 100, Role.STABLE, 0.0)]
    with pytest.raises(InvalidArgument, match="retiring"):
        routes.set_weights("m", {STABLE: 5})
    assert routes.next_retire_at() == 1_300.0
    clock.now = 1_299.0
    assert routes.retire_due() == []
    clock.now = 1_300.0
    assert [v.model for v in routes.retire_due()] == [STABLE]
    assert [v.model for v in routes.route("m").versions] == [CANARY]
    assert routes.next_retire_at() is None


def test_promoting_the_retiring_version_back_is_an_instant_rollback() -> None:
    routes = table(90, 10)
    routes.promote(CANARY, 300.0)
    route = routes.promote(STABLE, 60.0)
    assert [(v.model, v.weight, v.role) for v in route.versions] == [(STABLE, 100, Role.STABLE),
                                                                       (CANARY, 0, Role.RETIRING)]


def test_rollback_takes_the_canaries_traffic_and_keeps_the_reason() -> None:
    routes = table(70, 30)
    route = routes.rollback("m", "canary ttft p95 412 ms > stable 180 ms x 1.5")
    assert [(v.weight, v.rolled_back_reason) for v in route.versions] == [
        (100, ""), (0, "canary ttft p95 412 ms > stable 180 ms x 1.5")]
    with pytest.raises(NotFound):
        routes.rollback("x", "")


def test_remove_refuses_the_stable_version_and_the_last_one_with_traffic() -> None:
    routes = table(0, 100)
    with pytest.raises(FailedPrecondition, match="stable"):
        routes.remove_version(STABLE)
    with pytest.raises(FailedPrecondition, match="only version"):
        routes.remove_version(CANARY)
    routes.set_weights("m", {STABLE: 100, CANARY: 0})
    assert [v.model for v in routes.remove_version(CANARY).versions] == [STABLE]
    with pytest.raises(NotFound):
        routes.remove_version(CANARY)


def test_a_change_to_a_copy_leaves_the_original_as_it_was() -> None:
    routes = table(70, 30)
    changed = routes.copy()
    changed.promote(CANARY, 10.0)
    assert [(v.weight, v.role) for v in routes.route("m").versions] == [(70, Role.STABLE), (30, Role.CANARY)]
