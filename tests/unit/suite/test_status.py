"""``aiserve status``: the table from plain rows (a pure function), and the command against a
small real gRPC server implementing the Admin service (the edge: the gateway's own servicer is
tested with the gateway)."""

from __future__ import annotations

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
from suite.status import Row, format_bytes, format_duration, format_table, rows_from, to_json

MIB = 1 << 20


def status(service: str, state: int = status_pb2.SERVING_STATE_SERVING, **fields: object) -> status_pb2.ServiceStatus:
    return status_pb2.ServiceStatus(service=service, state=state, **fields)  # type: ignore[arg-type]


def fleet(*backends: status_pb2.ServiceStatus) -> admin_pb2.FleetStatus:
    gateway = status("gateway", address="127.0.0.1:50051", running=3, rss_bytes=210 * MIB, uptime_s=312)
    return admin_pb2.FleetStatus(gateway=gateway, backends=backends)


SERVING_FLEET = fleet(
    status("tokenizer", route="smollm2@0.1.2", address="127.0.0.1:50052", model="smollm2@0.1.2",
           rss_bytes=180 * MIB, uptime_s=3725),
    status("inference", route="smollm2@0.1.2", address="127.0.0.1:50053", model="smollm2@0.1.2", queue_length=2,
           running=5, kv_used_bytes=12 * MIB, kv_total_bytes=3 << 30, rss_bytes=1536 * MIB, uptime_s=59),
)


def test_the_table_has_the_gateway_first_and_says_why_a_service_is_not_serving() -> None:
    rows = rows_from(fleet(
        status("inference", status_pb2.SERVING_STATE_NOT_SERVING, route="smollm2@0.1.2",
               address="127.0.0.1:50063", reason="draining", model="smollm2@0.1.2", kv_total_bytes=3 << 30),
        status("inference", status_pb2.SERVING_STATE_UNREACHABLE, route="smollm2@0.1.2",
               address="127.0.0.1:50073", reason="connection refused"),
    ))
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["SERVICE", "ROUTE", "ADDRESS", "STATE", "MODEL", "QUEUE", "RUNNING", "KV",
                                "USED/TOTAL", "RSS", "UPTIME"]
    assert lines[1].split() == ["gateway", "-", "127.0.0.1:50051", "SERVING", "-", "0", "3", "-", "210.0", "MiB",
                                "5m12s"]
    assert "NOT_SERVING (draining)" in lines[2] and "-/3.0 GiB" in lines[2]
    assert "UNREACHABLE (connection refused)" in lines[3]
    starts = {line.index("127.0.0.1") for line in lines[1:]}
    assert starts == {lines[0].index("ADDRESS")}  # the columns line up
    assert all(line == line.rstrip() for line in lines)


def test_figures_are_readable() -> None:
    assert [format_bytes(n) for n in (0, 512, 1536, 12 * MIB, 3 << 30)] == ["-", "512 B", "1.5 KiB", "12.0 MiB",
                                                                           "3.0 GiB"]
    assert [format_duration(s) for s in (0, 42.7, 312, 3725, 90061)] == ["-", "42s", "5m12s", "1h02m", "1d01h"]


def test_json_holds_the_same_rows_with_raw_figures() -> None:
    rows = rows_from(SERVING_FLEET)
    data = json.loads(to_json(rows))
    assert data["serving"] is True
    assert [Row(**row) for row in data["services"]] == rows
    assert data["services"][2]["kv_total_bytes"] == 3 << 30


class FakeAdmin(admin_pb2_grpc.AdminServicer):
    """The gateway's Admin service as far as ``aiserve status`` sees it."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.reply = SERVING_FLEET

    def GetFleetStatus(self, request: admin_pb2.FleetStatusRequest,  # noqa: N802 - gRPC method name
                       context: grpc.ServicerContext) -> admin_pb2.FleetStatus:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.key}":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not the admin key")
        return self.reply


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[tuple[FakeAdmin, str, Path]]:
    """A running fake Admin service, its address, and a home whose admin.key it accepts."""
    servicer = FakeAdmin(ensure_admin_key(tmp_path / "admin.key"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}", tmp_path
    finally:
        server.stop(None)


def run_status(*argv: str) -> int:
    args = build_parser().parse_args(["status", *argv])
    code: int = args.func(args)
    return code


def test_all_serving_prints_the_table_and_exits_0(admin: tuple[FakeAdmin, str, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _, address, home = admin
    assert run_status("--address", address, "--home", str(home)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("SERVICE") and out[1].startswith("gateway") and len(out) == 4
    assert run_status("--address", address, "--home", str(home), "--json") == 0
    assert json.loads(capsys.readouterr().out)["services"][0]["service"] == "gateway"


def test_something_not_serving_exits_1(admin: tuple[FakeAdmin, str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address, home = admin
    servicer.reply = fleet(status("inference", status_pb2.SERVING_STATE_NOT_SERVING, reason="loading"))
    assert run_status("--address", address, "--home", str(home)) == 1
    assert "NOT_SERVING (loading)" in capsys.readouterr().out


def test_an_unreachable_gateway_exits_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert run_status("--address", f"127.0.0.1:{port}", "--admin-key", "aisadm_" + "0" * 64, "--timeout", "5") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and f"127.0.0.1:{port}" in captured.err
    assert "UNAVAILABLE" in captured.err


def test_no_key_or_a_refused_key_is_a_usage_error(admin: tuple[FakeAdmin, str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _, address, _ = admin
    assert run_status("--address", address, "--home", str(tmp_path / "empty")) == 2
    assert "no admin key" in capsys.readouterr().err
    assert run_status("--address", address, "--admin-key", "aisadm_" + "f" * 64) == 2
    assert "refused the admin key" in capsys.readouterr().err
