"""The runner's watch for its own instances that left the gateway's routes."""

from __future__ import annotations

from aiserve.v1 import admin_pb2
from suite.retire_watch import retired, routed_addresses


def routes(*targets: tuple[str, str]) -> admin_pb2.RouteList:
    return admin_pb2.RouteList(routes=[admin_pb2.Route(name="m", versions=[
        admin_pb2.RouteVersion(model=f"m@{i}", tokenizer_target=t, inference_target=inf)
        for i, (t, inf) in enumerate(targets)])])


def test_the_addresses_a_route_names() -> None:
    listed = routes(("127.0.0.1:1", "ipv4:127.0.0.1:2,127.0.0.1:3"), ("dns:///x.svc:5", "nonsense"))
    assert routed_addresses(listed) == {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}


def test_only_an_instance_seen_on_a_route_and_gone_from_all_is_retired() -> None:
    instances = {"tokenizer": "127.0.0.1:1", "inference": "127.0.0.1:2"}
    seen: set[str] = set()
    assert retired(instances, seen, {"127.0.0.1:9"}) == []  # never routed (an old routes file): left alone
    assert retired(instances, seen, {"127.0.0.1:1", "127.0.0.1:2"}) == []
    assert retired(instances, seen, {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:7"}) == []
    assert retired(instances, seen, {"127.0.0.1:7"}) == ["tokenizer", "inference"]
