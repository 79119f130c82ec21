"""The ``aiserve`` command line's arguments for running the suite and asking its status."""

from __future__ import annotations

import pytest

from suite.cli import build_parser


def test_run_takes_a_replica_count() -> None:
    args = build_parser().parse_args(["run", "--inference-replicas", "3"])
    assert (args.inference_replicas, args.timeout) == (3, 300)
    assert build_parser().parse_args(["run"]).inference_replicas is None  # then $AISERVE_INFERENCE_REPLICAS, or 1


@pytest.mark.parametrize("count", ["0", "-2", "two"])
def test_a_replica_count_below_one_is_a_usage_error(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", "--inference-replicas", count])
    assert info.value.code == 2
    assert "--inference-replicas" in capsys.readouterr().err


def test_status_defaults_to_the_local_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AISERVE_GATEWAY_PORT", raising=False)
    args = build_parser().parse_args(["status"])
    assert (args.address, args.admin_key, args.json, args.timeout) == ("127.0.0.1:50051", None, False, 5.0)
    monkeypatch.setenv("AISERVE_GATEWAY_PORT", "50061")
    args = build_parser().parse_args(["status", "--json", "--admin-key", "k"])
    assert (args.address, args.admin_key, args.json) == ("127.0.0.1:50061", "k", True)
