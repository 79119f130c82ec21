"""``aiserve rollout``: the side-by-side view and the choices (pure functions of plain rows), its
arguments, and each action against a small real gRPC server implementing the Admin routes rpcs
(the edge: the gateway's own servicer is tested with the gateway)."""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from aiserve.v1 import admin_pb2, admin_pb2_grpc, status_pb2
from services.gateway.admin_key import ensure_admin_key
from suite.cli import build_parser
from suite.rollout import DEFAULT_REASON, route_row
from suite.rollout_view import (
    RouteRow,
    UsageError,
    format_list,
    format_status,
    pick_canary,
    pick_route,
    weights_for,
)

STABLE, CANARY = "smollm2@0.1.2", "smollm2@0.1.3"
SERVING = status_pb2.SERVING_STATE_SERVING


def figures(requests: int, error_rate: float, ttft: tuple[float, float]) -> admin_pb2.VersionFigures:
    return admin_pb2.VersionFigures(window_s=300, requests=requests, error_rate=error_rate, ttft_p50_ms=ttft[0],
                                    ttft_p95_ms=ttft[1], tpot_p50_ms=30, tpot_p95_ms=45, cache_hit_rate=0.12,
                                    mean_cost_micros=213.4, negative_feedback_rate=0.015)


def version(model: str, weight: int, role: int, **fields: object) -> admin_pb2.RouteVersion:
    return admin_pb2.RouteVersion(model=model, weight=weight, role=role, state=SERVING,  # type: ignore[arg-type]
                                  tokenizer_target="127.0.0.1:50052", inference_target="127.0.0.1:50053", **fields)


def route(*versions: admin_pb2.RouteVersion, name: str = "smollm2") -> admin_pb2.Route:
    return admin_pb2.Route(name=name, versions=versions, stickiness=admin_pb2.STICKINESS_TENANT)


def canary_route() -> admin_pb2.Route:
    return route(
        version(CANARY, 10, admin_pb2.VERSION_ROLE_CANARY, figures=figures(131, 0.008, (90, 412))),
        version(STABLE, 90, admin_pb2.VERSION_ROLE_STABLE, figures=figures(1204, 0.002, (85, 180))),
    )


def by_label(lines: list[str]) -> dict[str, str]:
    """The status lines under the header, by their label (the text left of the first column)."""
    first = lines[1].index("STABLE")
    return {line[:first].strip(): line[first:] for line in lines[2:]}


def test_status_shows_stable_and_canary_side_by_side() -> None:
    lines = format_status(route_row(canary_route()), now_unix_s=0).splitlines()
    assert lines[0] == "route smollm2 (stickiness tenant; figures over the last 300 s)"
    assert lines[1].split() == ["STABLE", "CANARY"]  # stable first, whatever the gateway's order
    rows = by_label(lines)
    assert rows["model"].split() == [STABLE, CANARY]
    assert rows["weight"].split() == ["90", "10"]
    assert rows["requests"].split() == ["1204", "131"]
    assert rows["error rate"].split() == ["0.2%", "0.8%"]
    assert rows["ttft p50/p95"].split() == ["85/180", "ms", "90/412", "ms"]
    assert rows["tpot p50/p95"].split() == ["30/45", "ms", "30/45", "ms"]
    assert rows["cache hit rate"].split() == ["12.0%", "12.0%"]
    assert rows["mean cost"].split() == ["213", "micros", "213", "micros"]
    assert rows["negative feedback"].split() == ["1.5%", "1.5%"]
    assert rows["state"].split() == ["SERVING", "SERVING"]
    assert rows["rolled back"].split() == ["-", "-"]
    assert lines[1].index("CANARY") == lines[2].index(CANARY)  # the columns line up
    assert all(line == line.rstrip() for line in lines)


def test_status_of_a_version_without_requests_a_rollback_and_a_retiring_version() -> None:
    row = route_row(route(
        version(STABLE, 100, admin_pb2.VERSION_ROLE_STABLE, figures=figures(50, 0.0, (80, 90))),
        version(CANARY, 0, admin_pb2.VERSION_ROLE_CANARY, rolled_back_reason="canary ttft p95 412 ms > 180 ms"),
        version("smollm2@0.1.1", 0, admin_pb2.VERSION_ROLE_RETIRING, retire_at_unix_s=1250.0),
    ))
    lines = format_status(row, now_unix_s=1000).splitlines()
    assert lines[1].split() == ["STABLE", "CANARY", "RETIRING"]
    rows = by_label(lines)
    assert rows["error rate"].split() == ["0.0%", "-", "-"]
    assert rows["ttft p50/p95"].split() == ["80/90", "ms", "-", "-"]
    assert rows["rolled back"].split() == ["-", "yes", "(below)", "-"]
    assert lines[-1] == f"{CANARY} rolled back: canary ttft p95 412 ms > 180 ms"
    assert rows["retires"].split() == ["-", "-", "in", "4m10s"]


def test_list_has_one_line_per_version() -> None:
    lines = format_list([route_row(canary_route()), route_row(route(
        version("other@1", 100, admin_pb2.VERSION_ROLE_STABLE), name="other"))]).splitlines()
    assert lines[0].split()[:5] == ["ROUTE", "MODEL", "ROLE", "WEIGHT", "STATE"]
    assert lines[1].split() == ["smollm2", STABLE, "stable", "90", "SERVING", "1204", "0.2%", "180", "ms", "-"]
    assert lines[2].split()[:4] == ["smollm2", CANARY, "canary", "10"]
    assert lines[3].split() == ["other", "other@1", "stable", "100", "SERVING", "0", "-", "-", "-"]


def test_the_route_and_the_canary_are_chosen_or_refused_with_a_reason() -> None:
    one, other = route_row(canary_route()), route_row(route(name="other"))
    assert pick_route([one], None) is one
    assert pick_route([one, other], "other") is other
    for routes, name, message in (([one, other], None, "2 routes (smollm2, other): name one with --route"),
                                  ([one], "nope", "no route 'nope' (routes: smollm2)"),
                                  ([], None, "0 routes (none)")):
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            pick_route(routes, name)
    assert pick_canary(one, None).model == CANARY
    assert pick_canary(one, CANARY).model == CANARY
    with pytest.raises(UsageError, match="has no canary 'smollm2@0.1.2'"):
        pick_canary(one, STABLE)  # the stable version is no canary
    with pytest.raises(UsageError, match="has no canary: add a version first"):
        pick_canary(route_row(route(version(STABLE, 100, admin_pb2.VERSION_ROLE_STABLE))), None)
    two = dataclasses.replace(one, versions=(*one.versions, dataclasses.replace(one.versions[0], model="smollm2@9")))
    with pytest.raises(UsageError, match="2 canaries .* name one with --canary"):
        pick_canary(two, None)


def test_weight_n_gives_the_stable_version_the_rest() -> None:
    row = route_row(canary_route())
    canary = pick_canary(row, None)
    assert weights_for(row, canary, 10) == {CANARY: 10, STABLE: 90}
    assert weights_for(row, canary, 100) == {CANARY: 100, STABLE: 0}
    with pytest.raises(UsageError, match="weight: must be 0..100, got 101"):
        weights_for(row, canary, 101)
    with pytest.raises(UsageError, match="no stable version"):
        weights_for(RouteRow("smollm2", "none", (canary,)), canary, 10)


@pytest.mark.parametrize("text", ["101", "-1", "ten", "5.5", ""])
def test_a_weight_out_of_0_to_100_is_a_usage_error(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["rollout", "weight", text])
    assert info.value.code == 2
    assert "must be a whole number 0..100" in capsys.readouterr().err


def test_the_arguments_and_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AISERVE_GATEWAY_PORT", raising=False)
    args = build_parser().parse_args(["rollout", "weight", "0", "--canary", CANARY, "--route", "smollm2"])
    assert (args.action, args.percent, args.canary, args.route, args.address) == (
        "weight", 0, CANARY, "smollm2", "127.0.0.1:50051")
    assert build_parser().parse_args(["rollout", "rollback"]).reason == DEFAULT_REASON
    assert build_parser().parse_args(["rollout", "promote"]).retire_after == 0.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rollout"])  # an action is required


class FakeAdmin(admin_pb2_grpc.AdminServicer):
    """The gateway's routes rpcs as far as ``aiserve rollout`` sees them, on one route."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.route = canary_route()
        self.requests: list[object] = []
        self.refuse: str = ""

    def _check(self, request: object, context: grpc.ServicerContext) -> None:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.key}":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not the admin key")
        self.requests.append(request)
        if self.refuse and not isinstance(request, admin_pb2.ListRoutesRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)

    def ListRoutes(self, request: admin_pb2.ListRoutesRequest,  # noqa: N802 - gRPC method name
                   context: grpc.ServicerContext) -> admin_pb2.RouteList:
        self._check(request, context)
        return admin_pb2.RouteList(routes=[self.route])

    def SetWeights(self, request: admin_pb2.SetWeightsRequest,  # noqa: N802
                   context: grpc.ServicerContext) -> admin_pb2.Route:
        self._check(request, context)
        for v in self.route.versions:
            v.weight = request.weights.get(v.model, v.weight)
        return self.route

    def Promote(self, request: admin_pb2.PromoteRequest,  # noqa: N802
                context: grpc.ServicerContext) -> admin_pb2.Route:
        self._check(request, context)
        for v in self.route.versions:
            promoted = v.model == request.model
            v.role = admin_pb2.VERSION_ROLE_STABLE if promoted else admin_pb2.VERSION_ROLE_RETIRING
            v.weight = 100 if promoted else 0
        return self.route

    def Rollback(self, request: admin_pb2.RollbackRequest,  # noqa: N802
                 context: grpc.ServicerContext) -> admin_pb2.Route:
        self._check(request, context)
        for v in self.route.versions:
            stable = v.role == admin_pb2.VERSION_ROLE_STABLE
            v.weight = 100 if stable else 0
            v.rolled_back_reason = "" if stable else request.reason
        return self.route


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[tuple[FakeAdmin, list[str]]]:
    """A running fake Admin service, and the arguments that reach it with an accepted key."""
    servicer = FakeAdmin(ensure_admin_key(tmp_path / "admin.key"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, ["--address", f"127.0.0.1:{port}", "--home", str(tmp_path), "--timeout", "10"]
    finally:
        server.stop(None)


def rollout(*argv: str) -> int:
    args = build_parser().parse_args(["rollout", *argv])
    code: int = args.func(args)
    return code


def test_status_and_list_read_the_routes(admin: tuple[FakeAdmin, list[str]],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _, reach = admin
    assert rollout("status", *reach) == 0
    out = capsys.readouterr().out
    assert out.startswith("route smollm2") and "90/412 ms" in out
    assert rollout("list", *reach, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert [v["model"] for v in data["routes"][0]["versions"]] == [CANARY, STABLE]
    assert data["routes"][0]["versions"][0]["ttft_p95_ms"] == 412


def last_change(servicer: FakeAdmin) -> object:
    """The last request that was not a ListRoutes (each command also reads the routes after)."""
    return [r for r in servicer.requests if not isinstance(r, admin_pb2.ListRoutesRequest)][-1]


def test_weight_sets_the_canary_and_the_stable_version(admin: tuple[FakeAdmin, list[str]],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    servicer, reach = admin
    assert rollout("weight", "25", *reach) == 0
    sent = last_change(servicer)
    assert isinstance(sent, admin_pb2.SetWeightsRequest)
    assert (sent.name, dict(sent.weights)) == ("smollm2", {CANARY: 25, STABLE: 75})
    weights = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("weight"))
    assert weights.split() == ["weight", "75", "25"]  # the route as the gateway answered it


def test_weight_without_a_canary_is_refused_before_any_change(admin: tuple[FakeAdmin, list[str]],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    servicer, reach = admin
    servicer.route = route(version(STABLE, 100, admin_pb2.VERSION_ROLE_STABLE))
    assert rollout("weight", "10", *reach) == 2
    assert "has no canary" in capsys.readouterr().err
    assert all(isinstance(r, admin_pb2.ListRoutesRequest) for r in servicer.requests)


def test_promote_makes_the_canary_stable(admin: tuple[FakeAdmin, list[str]],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    servicer, reach = admin
    assert rollout("promote", "--retire-after", "60", *reach, "--json") == 0
    sent = last_change(servicer)
    assert isinstance(sent, admin_pb2.PromoteRequest) and (sent.model, sent.retire_after_s) == (CANARY, 60.0)
    versions = json.loads(capsys.readouterr().out)["routes"][0]["versions"]
    assert {v["model"]: (v["role"], v["weight"]) for v in versions} == {CANARY: ("stable", 100),
                                                                       STABLE: ("retiring", 0)}


def test_rollback_sends_the_reason_and_shows_it(admin: tuple[FakeAdmin, list[str]],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    servicer, reach = admin
    assert rollout("rollback", "--reason", "answers too long", *reach) == 0
    sent = last_change(servicer)
    assert isinstance(sent, admin_pb2.RollbackRequest) and (sent.name, sent.reason) == ("smollm2", "answers too long")
    out = capsys.readouterr().out
    assert "answers too long" in out
    assert next(line for line in out.splitlines() if line.startswith("weight")).split() == ["weight", "100", "0"]


def test_a_change_the_gateway_refuses_is_a_usage_error(admin: tuple[FakeAdmin, list[str]],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    servicer, reach = admin
    servicer.refuse = "no version would keep a weight above 0"
    assert rollout("weight", "100", *reach) == 2
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "no version would keep a weight above 0" in err


def test_an_unknown_route_or_a_refused_key_is_a_usage_error(admin: tuple[FakeAdmin, list[str]],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _, reach = admin
    assert rollout("status", *reach, "--route", "nope") == 2
    assert "no route 'nope'" in capsys.readouterr().err
    assert rollout("status", *reach, "--admin-key", "aisadm_" + "f" * 64) == 2
    assert "refused the admin key" in capsys.readouterr().err


def test_an_unreachable_gateway_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert rollout("status", "--address", f"127.0.0.1:{port}", "--admin-key", "aisadm_" + "0" * 64) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
