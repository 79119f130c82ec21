"""ReplicaSet: round-robin over the usable replicas only; none usable is UNAVAILABLE naming each
replica's reason (pure logic, no grpc)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from aiserve.common.errors import Unavailable
from services.gateway.replicas import ReplicaSet


@dataclass
class Fake:
    address: str
    is_usable: bool = True
    reason: str = ""


def replica_set(*members: Fake) -> ReplicaSet[Fake]:
    replicas: ReplicaSet[Fake] = ReplicaSet("inference")
    for member in members:
        replicas.add(member)
    return replicas


def test_round_robin_over_the_serving_replicas() -> None:
    a, b, c = Fake("a:1"), Fake("b:1"), Fake("c:1")
    replicas = replica_set(a, b, c)
    assert [replicas.pick().address for _ in range(6)] == ["a:1", "b:1", "c:1"] * 2


def test_not_serving_and_removed_replicas_are_skipped_until_they_serve_again() -> None:
    a, b, c = Fake("a:1"), Fake("b:1", is_usable=False, reason="draining"), Fake("c:1")
    replicas = replica_set(a, b, c)
    assert Counter(replicas.pick().address for _ in range(10)) == {"a:1": 5, "c:1": 5}
    assert replicas.remove("c:1") is c
    assert {replicas.pick().address for _ in range(4)} == {"a:1"}
    b.is_usable, b.reason = True, ""
    assert Counter(replicas.pick().address for _ in range(4)) == {"a:1": 2, "b:1": 2}
    assert replicas.pick(exclude=("a:1",)).address == "b:1"  # a retry goes elsewhere


def test_none_usable_is_unavailable_naming_each_replica_and_its_reason() -> None:
    replicas = replica_set(Fake("a:1", False, "UNAVAILABLE: connection refused"), Fake("b:1", False, "draining"))
    with pytest.raises(Unavailable) as info:
        replicas.pick()
    assert info.value.message == ("inference unavailable: no replica SERVING "
                                  "(a:1: UNAVAILABLE: connection refused; b:1: draining)")
    ok = replica_set(Fake("a:1"))
    with pytest.raises(Unavailable, match=r"a:1: just failed"):
        ok.pick(exclude=("a:1",))
    with pytest.raises(Unavailable, match="no replica known"):
        replica_set().pick()
